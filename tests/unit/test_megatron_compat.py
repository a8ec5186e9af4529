"""Megatron-LM's flags (issue 34, points 1 and 6): every refusal of a command in one message, the
features the engine lacks refused in one line and accepted at their neutral value, selectors
stated as no-ops, --sequence-parallel at t=1 turned off, the sample-based lr flags against
Megatron's arithmetic, --kv-channels, --apply-layernorm-1p and the output paths checked before
anything runs (the batch-size ramps: test_ramp_arithmetic.py)."""
import math

import pytest
import torch

from megatron_2bw.config import ConfigError
from megatron_2bw.config.build import build_config
from megatron_2bw.config.paths import check_output_paths
from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.pretrain import build_parser

FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo",
       "max", "--fp8-param-gather"]


def refused(argv, capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        build_parser("gpt").parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()


def built(argv, world=1, eod=None):
    args = build_parser("gpt").parse_args(["--mock-data"] + argv)
    return build_config(args, "gpt", world, eod=eod)


def test_every_refusal_of_a_command_comes_in_one_message(capsys):
    lines = refused(["--num-layerz", "2", "--context-parallel-size", "2"] + FP8
                    + ["--bogus", "--num-experts", "8"], capsys)
    assert len(lines) == 5, lines
    assert lines[0].endswith("unknown flag --num-layerz (did you mean --num-layers?)")
    assert lines[1].endswith("unknown flag --bogus")
    assert "--context-parallel-size 2: context parallelism is not in this engine" in lines[2]
    assert "--num-experts 8: mixture of experts is not in this engine" in lines[3]
    assert all(flag in lines[4] for flag in FP8 if flag.startswith("--")) and "fp8" in lines[4]


@pytest.mark.parametrize("argv,value", [(["--fp16", "true"], "true"),
                                        (["--profile", "pt"], "pt"),  # Megatron-DeepSpeed's
                                        (["--num-layers", "2", "extra", "words"], "extra")])
def test_a_value_no_flag_takes_is_refused_not_dropped(argv, value, capsys):
    """argparse leaves a value after a switch to the unknown tokens; it was skipped there as an
    unknown flag's value, so `--fp16 true` passed and `--profile pt` ran ours unsaid."""
    assert refused(argv, capsys) == [f"pretrain_gpt.py: error: unexpected value {value!r}: no "
                                     "flag takes it (a switch takes no value); drop it"]
    # an unknown flag's values stay that flag's: one line for it
    assert refused(["--bogus", "3", "4"], capsys) == ["pretrain_gpt.py: error: unknown flag "
                                                      "--bogus"]


def test_fp8_flags_are_refused_in_one_line(capsys):
    (line,) = refused(FP8, capsys)
    assert line == ("pretrain_gpt.py: error: --fp8-format hybrid, --fp8-amax-history-len 1024, "
                    "--fp8-amax-compute-algo max, --fp8-param-gather: fp8 training is not in "
                    "this engine; train in --bf16 (drop the fp8 flags)")


def test_neutral_values_are_accepted_and_selectors_are_stated():
    b = built(["--context-parallel-size", "1", "--expert-model-parallel-size", "1",
               "--fp8-amax-compute-algo", "most_recent", "--attention-backend", "fused",
               "--use-mcore-models", "--transformer-impl", "local", "--overlap-param-gather"])
    notes = "\n".join(b.notes)
    for flag in ("--attention-backend fused", "--use-mcore-models", "--transformer-impl local",
                 "--overlap-param-gather"):
        assert f"megatron-2bw: {flag}: " in notes, flag
    assert len([n for n in b.notes if "pipeline stage" not in n]) == 4  # + the d=1 schedule line
    help_text = build_parser("gpt").format_help()
    assert "--overlap-param-gather" in help_text and "all-gathers the new" in help_text


def test_sequence_parallel_at_t1_warns_and_turns_off():
    b = built(["--sequence-parallel"])
    assert b.config.parallel.sequence_parallel is False
    assert any("warning: --sequence-parallel" in n and "turned off" in n for n in b.notes)
    b = built(["--sequence-parallel", "--tensor-model-parallel-size", "2",
               "--hidden-size", "64", "--num-attention-heads", "4"], world=2)
    assert b.config.parallel.sequence_parallel is True
    assert not [n for n in b.notes if "sequence" in n]


def megatron_lr(num_steps, max_lr, min_lr, warmup_steps, decay_steps, style):
    """Megatron's OptimizerParamScheduler.get_lr, in samples, written out from its docs."""
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * num_steps / warmup_steps
    if num_steps > decay_steps:
        return min_lr
    ratio = (num_steps - warmup_steps) / (decay_steps - warmup_steps)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("flags,warmup,decay", [
    (["--train-iters", "40", "--lr-decay-iters", "30", "--lr-warmup-fraction", "0.1"],
     lambda B: 0.1 * 30 * B, lambda B: 30 * B),
    (["--train-samples", "160", "--lr-decay-samples", "130", "--lr-warmup-samples", "10"],
     lambda B: 10, lambda B: 130),
    (["--train-samples", "160", "--lr-warmup-fraction", "0.05"],
     lambda B: 0.05 * 160, lambda B: 160),
])
@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_sample_based_lr_flags_follow_megatron(flags, warmup, decay, style):
    cfg = built(flags + ["--global-batch-size", "4", "--lr", "0.1", "--min-lr", "0.01",
                         "--lr-decay-style", style]).config
    B = cfg.global_batch_size
    lr = LRSchedule(cfg.optimizer, cfg.train.train_iters, B)
    for it in range(cfg.train.train_iters):
        want = megatron_lr((it + 1) * B, 0.1, 0.01, warmup(B), decay(B), style)
        assert lr(it) == pytest.approx(want, rel=1e-12, abs=1e-15), it


@pytest.mark.parametrize("argv,message", [
    (["--train-iters", "4", "--lr-decay-samples", "10"], "--lr-decay-samples count samples"),
    (["--train-samples", "16", "--lr-decay-iters", "10"], "instead of --lr-decay-iters"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "excludes --lr-warmup-iters"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1]"),
])
def test_lr_flag_mixtures_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        built(argv)


def test_kv_channels_sets_the_head_width():
    from megatron_2bw.models.attention import SelfAttention
    cfg = built(["--hidden-size", "32", "--num-attention-heads", "4", "--kv-channels", "16",
                 "--group-query-attention", "--num-query-groups", "2",
                 "--hidden-dropout", "0", "--attention-dropout", "0"]).config  # exact: no dropout
    assert cfg.model.kv_channels == 16
    attn = SelfAttention(cfg.model, *_tp(), tracker=None, causal=True, init_std=0.02,
                         out_std=0.02)
    assert attn.qkv.weight.shape == ((4 + 2 * 2) * 16, 32)
    assert attn.proj.weight.shape == (32, 4 * 16)
    x = torch.randn(2, 5, 32)
    q, k, v = attn._qkv(x)
    ref = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 4.0
                        + torch.full((5, 5), float("-inf")).triu(1), -1) \
        @ v.repeat_interleave(2, 1)  # softmax(QK^T / sqrt(16)) V per head, causal
    want = attn.proj(ref.transpose(1, 2).reshape(2, 5, 64))
    assert torch.allclose(attn(x), want, atol=1e-6)


def _tp():
    from megatron_2bw.tensor_parallel import TPGroup
    return (TPGroup(),)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_is_the_plain_norm_with_gamma_plus_one(norm):
    from megatron_2bw.models.norms import build_norm
    plain = build_norm(built(["--normalization", norm]).config.model)
    one_p = build_norm(built(["--normalization", norm, "--apply-layernorm-1p"]).config.model)
    assert torch.count_nonzero(one_p.weight) == 0, "zero-centred gamma starts at 0"
    with torch.no_grad():
        one_p.weight.copy_(torch.randn(64) * 0.1)
        plain.weight.copy_(one_p.weight + 1)
        if norm == "LayerNorm":
            one_p.bias.copy_(torch.randn(64))
            plain.bias.copy_(one_p.bias)
    x = torch.randn(3, 7, 64, requires_grad=True)
    y1, y2 = one_p(x), plain(x)
    assert torch.allclose(y1, y2, atol=1e-6)
    g = torch.randn_like(y1)
    (gw1,) = torch.autograd.grad(y1, one_p.weight, g)
    (gw2,) = torch.autograd.grad(y2, plain.weight, g)
    assert torch.allclose(gw1, gw2, atol=1e-5)


def test_every_output_path_is_checked_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for flags, name in ((["--trace", str(blocker / "t")], "--trace"),
                        (["--tensorboard-dir", str(blocker / "tb")], "--tensorboard-dir"),
                        (["--wandb-project", "p", "--wandb-save-dir", str(blocker)],
                         "--wandb-save-dir"),
                        (["--profile", "--tensorboard-dir", str(blocker)], "--tensorboard-dir"),
                        (["--save", str(blocker / "ckpt")], "--save")):
        train = built(flags).config.train
        with pytest.raises(ConfigError) as e:
            check_output_paths(train)
        assert str(e.value).startswith(name) and "\n" not in str(e.value), (flags, e.value)
    ok = built(["--trace", str(tmp_path / "new" / "t")]).config.train
    check_output_paths(ok)
    assert (tmp_path / "new").is_dir()


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_qk_layernorm_normalizes_each_head_before_rope(norm):
    from megatron_2bw.models.attention import SelfAttention
    flags = ["--hidden-size", "32", "--num-attention-heads", "4", "--normalization", norm,
             "--position-embedding-type", "rope", "--group-query-attention",
             "--num-query-groups", "2"]
    with_norm = built(flags + ["--qk-layernorm"]).config.model
    plain_cfg = built(flags).config.model
    torch.manual_seed(0)
    attn = SelfAttention(with_norm, *_tp(), tracker=None, causal=True, init_std=0.02,
                         out_std=0.02)
    plain = SelfAttention(plain_cfg, *_tp(), tracker=None, causal=True, init_std=0.02,
                          out_std=0.02)
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if "layernorm" not in k})
    with torch.no_grad():
        for n in (attn.q_layernorm, attn.k_layernorm):
            n.weight.copy_(torch.randn(8))
    x = torch.randn(2, 5, 32)
    q, k, _ = attn._qkv(x)
    # the reference: plain attention's projections, normalized per head by hand, then RoPE
    plain.rope = None
    q0, k0, _ = plain._qkv(x)

    def by_hand(t, n):
        if norm == "RMSNorm":
            t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5)
        else:
            t = torch.nn.functional.layer_norm(t, (8,), eps=1e-5)
        return t * n.weight + (n.bias if norm == "LayerNorm" else 0)
    cos, sin = attn.rope.cos_sin(5, x.device, x.dtype)
    assert torch.allclose(q, attn.rope(by_hand(q0, attn.q_layernorm), cos, sin), atol=1e-5)
    assert torch.allclose(k, attn.rope(by_hand(k0, attn.k_layernorm), cos, sin), atol=1e-5)


def test_qk_layernorm_parameters_are_counted_and_t2_needs_sequence_parallel():
    from megatron_2bw.models.flops import layer_params
    from megatron_2bw.models.gpt import gpt_layer_specs
    cfg = built(["--qk-layernorm", "--kv-channels", "8", "--apply-layernorm-1p"]).config
    real = [sum(p.numel() for p in spec.build().parameters())
            for spec in gpt_layer_specs(cfg.model, *_tp())]
    assert [p for p, _ in layer_params(cfg.model)] == real
    with pytest.raises(ConfigError, match="--qk-layernorm at --tensor-model-parallel-size > 1 "
                                          "needs --sequence-parallel"):
        built(["--qk-layernorm", "--tensor-model-parallel-size", "2"], world=2)


# every flag of Megatron-LM's example scripts (examples/gpt3/train_gpt3_175b_distributed.sh both
# versions, train_gpt3_857m_distributed.sh, examples/bert/train_bert_340m_distributed.sh,
# examples/llama/train_llama3_8b_h100_fp8.sh, train_llama3_8b_h200_bf16.sh, train_llama2.sh),
# with the scripts' values where they parse here
EXAMPLE_FLAGS = """
--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32
--max-position-embeddings 32 --attention-backend auto --micro-batch-size 1 --global-batch-size 16
--rampup-batch-size 16 16 5859375 --train-iters 2 --weight-decay 0.1 --adam-beta1 0.9
--adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5
--lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
--use-mcore-models --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
--vocab-file V --merge-file M --split 949,50,1 --log-interval 100 --save-interval 10000
--eval-interval 1000 --save S --load S --eval-iters 10 --tensorboard-dir T
--ffn-hidden-size 128 --group-query-attention --num-query-groups 2 --kv-channels 16
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm
--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235 --context-parallel-size 1
--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --data-cache-path C
--tiktoken-pattern v2 --no-create-attention-mask-in-dataloader --no-mmap-bin-files
--num-workers 1 --log-throughput --profile --profile-step-start 4 --profile-step-end 6
--ckpt-format torch_dist --distributed-timeout-minutes 60 --wandb-project P
--wandb-exp-name E --wandb-save-dir W --log-timers-to-tensorboard --no-position-embedding
--no-async-tensor-model-parallel-allreduce --no-masked-softmax-fusion --dataloader-type single
--no-save-optim --no-load-optim --no-gradient-accumulation-fusion --distributed-backend gloo
--use-flash-attn --use-contiguous-parameters-in-local-ddp --disable-te-fused-rope
--transformer-impl transformer_engine --attention-softmax-in-fp32 --use-pytorch-profiler
--optimizer adam --log-params-norm --no-load-rng --use-checkpoint-args
""".split()
# the flags whose feature is not here (one line each below)
EXAMPLE_REFUSED = ["--log-num-zeros-in-grad"] + FP8


def test_every_flag_of_megatrons_example_scripts_is_taken(capsys):
    args = build_parser("gpt").parse_args(EXAMPLE_FLAGS)
    assert args.kv_channels == 16 and args.rampup_batch_size == [16, 16, 5859375]
    lines = refused(EXAMPLE_FLAGS + EXAMPLE_REFUSED, capsys)
    assert not [x for x in lines if "unknown flag" in x], lines
    features = ("logging the gradient's zeros", "fp8 training")
    assert len(lines) == len(features) and all(f in " ".join(lines) for f in features), lines
    bert = build_parser("bert").parse_args(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 4 --global-batch-size 32 "
        "--train-iters 10 --weight-decay 1e-2 --clip-grad 1.0 --fp16 --lr 0.0001 "
        "--lr-decay-iters 990000 --lr-decay-style linear --min-lr 1.0e-5 --weight-decay 1e-2 "
        "--lr-warmup-fraction .01 --clip-grad 1.0 --tensor-model-parallel-size 1 "
        "--pipeline-model-parallel-size 1 --data-path D --vocab-file V --split 949,50,1 "
        "--log-interval 100 --save-interval 10000 --eval-interval 1000 --save S --load S "
        "--eval-iters 10 --tensorboard-dir T".split())
    assert bert.lr_warmup_fraction == 0.01


def test_decoupled_lr_flags_are_taken_with_megatrons_meaning(capsys):
    """--decoupled-lr/--decoupled-min-lr reach the optimizer config (optim/lr.py steps the
    embedding and output layer with them); a negative one is a one-line error."""
    o = built(["--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5"]).config.optimizer
    assert (o.decoupled_lr, o.decoupled_min_lr) == (5.0e-4, 4.5e-5)
    o = built([]).config.optimizer
    assert (o.decoupled_lr, o.decoupled_min_lr) == (None, None)
    with pytest.raises(ConfigError, match=r"^--decoupled-lr must be >= 0, got -0.1$"):
        built(["--decoupled-lr", "-0.1"])


def test_no_position_embedding_is_taken_with_rope_only(capsys):
    b = built(["--position-embedding-type", "rope", "--no-position-embedding"])
    assert any("--no-position-embedding: with --position-embedding-type rope" in n
               for n in b.notes)
    (line,) = refused(["--no-position-embedding"], capsys)
    assert "a GPT without any position information is not in this engine" in line


def test_exit_on_missing_checkpoint_stops_where_a_job_would_start_from_scratch(tmp_path, capsys):
    from megatron_2bw.pretrain import parse
    ckpt = str(tmp_path / "ckpt")
    argv = ["--mock-data", "--train-iters", "2", "--load", ckpt, "--save", ckpt]
    assert parse("gpt", argv).cfg.train.load == ckpt  # without the flag: a fresh start
    with pytest.raises(SystemExit) as e:
        parse("gpt", argv + ["--exit-on-missing-checkpoint"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --exit-on-missing-checkpoint: --load {ckpt} holds no checkpoint; drop the flag "
        "to start from scratch")


def test_eod_mask_loss_leaves_end_of_document_positions_out(capsys):
    from megatron_2bw.data.mock import GPTBatches
    from megatron_2bw.models.families import model_parts
    from megatron_2bw.training.build import batches
    samples = [torch.tensor([5, 1, 2, 5, 3, 4]), torch.tensor([1, 5, 5, 2, 3, 1])]
    tokens, labels = next(GPTBatches(samples, 2, 1, eod=5))
    assert torch.equal(tokens, torch.stack(samples)[:, :-1])
    assert labels.tolist() == [[-1, 2, 5, -1, 4], [5, -1, -1, 3, 1]]  # input 5: no loss
    cfg = built(["--eod-mask-loss", "--vocab-size", "64", "--micro-batch-size", "2"], eod=5).config
    assert cfg.model.eod_mask_loss and cfg.model.eod_token == 5
    x, y = next(batches(cfg, samples, 1, 0))
    assert torch.equal(y, labels)
    _, loss_fn, _ = model_parts(cfg)
    logits = torch.randn(2, 5, 64)
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, 64),
                                                  labels.clamp(min=0).reshape(-1),
                                                  reduction="none")
    keep = labels.reshape(-1) >= 0
    assert torch.allclose(loss_fn(logits, labels), per_token[keep].mean(), atol=1e-6)
    _, plain, _ = model_parts(built(["--vocab-size", "64"]).config)
    full = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), y.clamp(min=0).reshape(-1))
    assert torch.allclose(plain(logits, y.clamp(min=0)), full, atol=1e-6)
    with pytest.raises(ConfigError, match="--eod-mask-loss needs a GPT and a tokenizer"):
        built(["--eod-mask-loss"])
    (line,) = refused(["--eod-mask-loss", "--calculate-per-token-loss"], capsys)
    assert "--calculate-per-token-loss with --eod-mask-loss" in line


def test_wandb_runs_in_the_mode_wandb_mode_says_offline_when_unset():
    from megatron_2bw.training.observe.writers import wandb_mode
    assert wandb_mode({}) == "offline" and wandb_mode({"WANDB_MODE": ""}) == "offline"
    assert wandb_mode({"WANDB_MODE": "online"}) == "online"
    assert wandb_mode({"WANDB_MODE": "disabled"}) == "disabled"


def test_reset_position_ids_restart_the_learned_positions_after_each_eod():
    from megatron_2bw.models.gpt import GPTEmbedding, reset_positions
    tokens = torch.tensor([[5, 1, 2, 5, 3, 4], [1, 2, 3, 4, 5, 5]])
    assert reset_positions(tokens, 5).tolist() == [[0, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 0]]
    exact = ["--hidden-dropout", "0", "--attention-dropout", "0"]  # compared exactly: no dropout
    cfg = built(["--reset-position-ids", "--vocab-size", "64", *exact], eod=5).config.model
    emb = GPTEmbedding(cfg)
    want = emb.word_embeddings(tokens) + emb.position_embeddings(reset_positions(tokens, 5))
    assert torch.equal(emb(tokens), want)
    plain = GPTEmbedding(built(["--vocab-size", "64", *exact]).config.model)
    plain.load_state_dict(emb.state_dict())
    assert torch.equal(plain(tokens[1:, :5]), emb(tokens[1:, :5]))  # no eod before: the same
    with pytest.raises(ConfigError, match="--reset-position-ids needs a GPT and a tokenizer"):
        built(["--reset-position-ids"])


def test_reset_position_ids_with_rope_is_accepted_and_changes_nothing_as_in_megatron_core():
    """megatron-core's GPTModel builds RoPE from the sequence length alone (position_ids reach
    only the learned position table): the flag is accepted with one line and the model's
    output is the same as without it."""
    from megatron_2bw.models.families import model_parts
    from megatron_2bw.testing.reference import build_sequential
    rope = ["--position-embedding-type", "rope", "--vocab-size", "64", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--seq-length", "8", "--micro-batch-size", "2"]
    with_flag = built(["--reset-position-ids", *rope], eod=5)
    assert with_flag.config.model.reset_position_ids
    assert ("megatron-2bw: --reset-position-ids: no effect on RoPE positions, as in "
            "Megatron-core (the rotary angles come from the sequence length; position ids "
            "reach only a learned position table)") in with_flag.notes
    assert not [n for n in built(rope, eod=5).notes if "--reset-position-ids" in n]
    assert not [n for n in built(["--reset-position-ids", "--vocab-size", "64"], eod=5).notes
                if "--reset-position-ids" in n]  # learned positions: it has its effect
    tokens = torch.tensor([[5, 1, 2, 5, 3, 4, 5, 7], [1, 2, 3, 4, 5, 5, 6, 2]])
    def output(argv):
        cfg = built(argv, eod=5).config
        return build_sequential(cfg, model_parts(cfg)[0])(tokens)
    assert torch.equal(output(["--reset-position-ids", *rope]), output(rope))
    learned = rope[2:]  # the same tokens move a learned table's positions
    assert not torch.allclose(output(["--reset-position-ids", *learned]), output(learned))
    with pytest.raises(ConfigError, match="--reset-position-ids needs a GPT and a tokenizer"):
        built(["--reset-position-ids"])


def test_num_workers_is_megatrons_loader_process_count_and_never_negative():
    assert built([]).config.train.num_workers is None  # 2 on CUDA, 0 on CPUs (data/prefetch.py)
    assert built(["--num-workers", "3"]).config.train.num_workers == 3
    assert not [n for n in built(["--num-workers", "3"]).notes if "--num-workers" in n]
    with pytest.raises(ConfigError, match=r"^--num-workers must be >= 0, got -1$"):
        built(["--num-workers", "-1"])
