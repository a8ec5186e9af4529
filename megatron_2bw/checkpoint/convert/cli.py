"""`tools/checkpoint_convert.py`: checkpoints <-> HuggingFace model directories.

    python tools/checkpoint_convert.py export --load CHECKPOINT_DIR --save HF_DIR
    python tools/checkpoint_convert.py import --load HF_DIR --save CHECKPOINT_DIR \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    python tools/checkpoint_convert.py to-dist --load TORCH_FORMAT_DIR --save NEW_DIR
    python tools/checkpoint_convert.py to-megatron --load CHECKPOINT_DIR --save NEW_DIR

export: a checkpoint of any layout (t, d, any schedule; under 2BW the newest weights) becomes
`config.json` + `model.safetensors` of a GPT2LMHeadModel (the classic shape) or a
LlamaForCausalLM (RoPE, RMSNorm, SwiGLU), loadable with `AutoModelForCausalLM.from_pretrained`;
the recorded sentencepiece tokenizer comes along. import: a HuggingFace GPT-2 or Llama directory
becomes iteration 0 of a checkpoint for the given layout; `--load DIR` (plus `--finetune` to start
a new run's schedule and optimizer) trains from it with the printed model flags. Anything that
cannot be converted exactly is refused in one line that names the reason (exit 2). to-dist: a
checkpoint in Megatron's layout (`--ckpt-format torch`, one file per stage and tensor rank, any
version of this code) becomes the layout-free torch_dist format with its whole training state
(checkpoint/convert/to_dist.py), so that any layout and schedule resumes from it. to-megatron:
one of our checkpoints (either format, any layout) becomes megatron-core's torch_dist format
(checkpoint/convert/to_megatron.py): megatron-core's dist_checkpointing.load reads it into its
GPTModel / BertModel and Megatron-LM's pretrain_gpt.py --load continues from it (as from a
`--ckpt-format megatron` save).
"""
from __future__ import annotations

import sys

from megatron_2bw.config import SCHEDULES, Config, ModelConfig
from megatron_2bw.config.flags import FlagParser, exit_on_config_error
from megatron_2bw.schedule.kinds import default_schedule


def build_parser() -> FlagParser:
    p = FlagParser(prog="checkpoint_convert.py", description=__doc__.split("\n\n")[0],
                   allow_abbrev=False)
    sub = p.add_subparsers(dest="direction", required=True)
    e = sub.add_parser("export", help="checkpoint -> HuggingFace directory")
    e.add_argument("--load", required=True, help="checkpoint directory (a run's --save)")
    e.add_argument("--save", required=True, help="new HuggingFace directory")
    e.add_argument("--iteration", type=int, default=None, help="default: the newest")
    e.add_argument("--vocab-size", type=int, default=None,
                   help="cut the padded vocabulary to this size (Megatron's --true-vocab-size)")
    i = sub.add_parser("import", help="HuggingFace directory -> checkpoint")
    i.add_argument("--load", required=True, help="HuggingFace directory (config.json + weights)")
    i.add_argument("--save", required=True, help="new checkpoint directory")
    i.add_argument("--tensor-model-parallel-size", type=int, default=1)
    i.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    i.add_argument("--pipeline-schedule", choices=SCHEDULES, default=None,
                   help="default: pretrain's (flush at one pipeline stage, else 2bw)")
    i.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    c = sub.add_parser("to-dist", help="torch-format checkpoint -> torch_dist (layout-free)")
    c.add_argument("--load", required=True, help="a torch-format checkpoint directory")
    c.add_argument("--save", required=True, help="new checkpoint directory")
    c.add_argument("--iteration", type=int, default=None, help="default: the newest")
    g = sub.add_parser("to-megatron", help="checkpoint -> megatron-core torch_dist (Megatron-LM "
                                           "loads it)")
    g.add_argument("--load", required=True, help="a checkpoint directory (a run's --save)")
    g.add_argument("--save", required=True, help="new checkpoint directory")
    g.add_argument("--iteration", type=int, default=None, help="default: the newest")
    return p


def model_flags(m: ModelConfig) -> list[str]:
    """The model flags that describe `m` to pretrain_gpt.py (--seq-length is the run's choice)."""
    flags = ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size,
             "--num-attention-heads", m.num_attention_heads, "--ffn-hidden-size", m.ffn_size,
             "--vocab-size", m.vocab_size, "--init-method-std", m.init_method_std,
             "--hidden-dropout", m.hidden_dropout, "--attention-dropout", m.attention_dropout,
             "--norm-epsilon", m.layernorm_epsilon]
    if m.position_embedding_type == "learned_absolute":
        flags += ["--max-position-embeddings", m.max_positions]
    else:
        flags += ["--position-embedding-type", m.position_embedding_type,
                  "--rotary-base", m.rotary_base, "--rotary-percent", m.rotary_percent]
    if m.normalization != "LayerNorm":
        flags += ["--normalization", m.normalization]
    if m.group_query_attention:
        flags += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.num_kv_channels is not None:
        flags += ["--kv-channels", m.num_kv_channels]
    for on, flag in ((m.swiglu, "--swiglu"), (not m.add_bias_linear, "--disable-bias-linear"),
                     (m.openai_gelu, "--openai-gelu"),
                     (m.untie_embeddings_and_output_weights,
                      "--untie-embeddings-and-output-weights")):
        if on:
            flags.append(flag)
    return [f"{x:g}" if isinstance(x, float) else str(x) for x in flags]


def export(args) -> str:
    from megatron_2bw.checkpoint.convert.hf import export_hf
    from megatron_2bw.checkpoint.convert.native import read_checkpoint
    from megatron_2bw.checkpoint.convert.tokenizers import (carry_to_hf, eod_or_none,
                                                            recorded_tokenizer)
    model = read_checkpoint(args.load, args.iteration)
    tokenizer = recorded_tokenizer(args.load)
    eod = eod_or_none(tokenizer) if getattr(tokenizer, "name", "") != "NullTokenizer" else None
    kind = export_hf(model, args.save, args.vocab_size, eod)
    carried = carry_to_hf(args.load, args.save)
    return (f"exported iteration {model.iteration} of {args.load} as a {kind} to {args.save}"
            + (" with its sentencepiece tokenizer" if carried else "") +
            f"; load it with AutoModelForCausalLM.from_pretrained({args.save!r})")


def import_(args) -> str:
    from megatron_2bw.checkpoint.convert.hf import import_hf
    from megatron_2bw.checkpoint.convert.native import write_checkpoint
    from megatron_2bw.checkpoint.convert.tokenizers import carry_to_checkpoint, sentencepiece_flags
    t, d = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    base = Config(schedule=args.pipeline_schedule or default_schedule(d))
    model = import_hf(args.load, t, args.make_vocab_size_divisible_by, base)
    write_checkpoint(args.save, model, t, d)
    carry_to_checkpoint(args.load, args.save)
    flags = ["--load", args.save, "--tensor-model-parallel-size", str(t),
             "--pipeline-model-parallel-size", str(d)] + model_flags(model.config.model) + \
        sentencepiece_flags(args.save)
    return (f"imported {args.load} as iteration 0 of {args.save} (t={t}, d={d}); train from it "
            f"with pretrain_gpt.py {' '.join(flags)} --seq-length S [--finetune]")


def to_dist(args) -> str:
    from megatron_2bw.checkpoint.convert.to_dist import torch_to_dist
    it = torch_to_dist(args.load, args.save, args.iteration)
    return (f"wrote iteration {it} of {args.load} as a torch_dist checkpoint in {args.save}; "
            f"resume from it with --load {args.save} and any parallel layout")


def to_megatron(args) -> str:
    from megatron_2bw.checkpoint.convert.to_megatron import convert_to_megatron
    it = convert_to_megatron(args.load, args.save, args.iteration)
    return (f"wrote iteration {it} of {args.load} in megatron-core's torch_dist format in "
            f"{args.save}; Megatron-LM continues from it with --load {args.save} --ckpt-format "
            "torch_dist (and so does --load here)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    run = {"export": export, "import": import_, "to-dist": to_dist,
           "to-megatron": to_megatron}[args.direction]
    print(exit_on_config_error(lambda: run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
