"""Megatron-DeepSpeed's flags (its megatron/arguments.py, deepspeedai/Megatron-DeepSpeed), one test
per group, each checking the meaning: the model group's spellings build the config Megatron-LM's
flags build; --checkpoint-activations recomputes every layer in backward; --zero-stage is the
distributed optimizer and agrees with the DeepSpeed JSON or is refused; --train-tokens stops the
run; the selectors are stated and the features the engine lacks refused in one line.
(Token-based lr: test_mds_lr_tokens.py; the Llama-2 script: tests/e2e/test_mds_llama2_script.py.)
"""
import json

import pytest
import torch

from megatron_2bw.config import ConfigError
from megatron_2bw.config import compat_mds
from megatron_2bw.config.build import build_config
from megatron_2bw.config.compat import INSTEAD, NEUTRAL, NOTED
from megatron_2bw.models.families import model_parts
from megatron_2bw.models.stage import StageModule
from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.pretrain import build_parser


def built(argv, world=1):
    return build_config(build_parser("gpt").parse_args(["--mock-data"] + argv), "gpt", world)


def refused(argv, capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        build_parser("gpt").parse_args(["--mock-data"] + argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()


# -- the model group: Megatron-DeepSpeed's spellings are Megatron-LM's settings ------------------
def test_the_model_groups_spellings_build_megatron_lms_config():
    shape = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    mds = built(shape + ["--normalization", "rmsnorm", "--layernorm-epsilon", "1e-6",
                         "--use-rotary-position-embeddings",
                         "--rotary-position-embeddings-theta", "500000",
                         "--num-key-value-heads", "2", "--no-query-key-layer-scaling"])
    mlm = built(shape + ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
                         "--position-embedding-type", "rope", "--rotary-base", "500000",
                         "--group-query-attention", "--num-query-groups", "2"])
    assert mds.config == mlm.config
    m = mds.config.model
    assert (m.normalization, m.layernorm_epsilon, m.position_embedding_type, m.rotary_base,
            m.query_groups) == ("RMSNorm", 1e-6, "rope", 500000.0, 2)
    notes = "\n".join(mds.notes)
    assert "megatron-2bw: --no-query-key-layer-scaling: the scores are not scaled" in notes
    assert "megatron-2bw: --num-key-value-heads 2: grouped-query attention" in notes
    # as many key/value heads as heads: plain attention, the same model as without the flag
    assert built(shape + ["--num-key-value-heads", "4"]).config == built(shape).config
    assert built(["--normalization", "layernorm"]).config.model.normalization == "LayerNorm"


@pytest.mark.parametrize("argv,line", [
    (["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"],
     "--use-rotary-position-embeddings (RoPE) with --position-embedding-type learned_absolute: "
     "give one of them"),
    (["--num-key-value-heads", "2", "--group-query-attention", "--num-query-groups", "1"],
     "--num-key-value-heads 2 with --num-query-groups 1: give one of them"),
    (["--rotary-position-embeddings-theta", "500000", "--rotary-base", "10000"],
     "--rotary-position-embeddings-theta 500000 with --rotary-base 10000: give one of them"),
])
def test_the_two_spellings_given_apart_are_one_line(argv, line, capsys):
    assert refused(argv, capsys) == [f"pretrain_gpt.py: error: {line}"]


# -- activation checkpointing ------------------------------------------------------------------
def _layer_runs(cfg) -> int:
    """Transformer-layer forwards in one forward + backward of the model as the engine builds a
    stage (models/stage.py with the config's recompute settings)."""
    specs, loss_fn, _ = model_parts(cfg)
    m = cfg.model
    module = StageModule(specs, 0, len(specs), seed=cfg.train.seed,
                         recompute_method=m.recompute_method,
                         recompute_num_layers=m.recompute_num_layers)
    runs = []
    for i, spec in enumerate(specs):
        if spec.name == "transformer":
            module.layers[str(i)].register_forward_hook(lambda *_: runs.append(1))
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_length))
    loss_fn(module(tokens), torch.randint(0, m.vocab_size, (2, m.seq_length))).backward()
    return len(runs)


def test_checkpoint_activations_recomputes_every_layer_in_chunks():
    shape = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "8", "--vocab-size", "64"]
    for extra, n in (([], 1), (["--checkpoint-num-layers", "2"], 2)):
        mds = built(shape + ["--checkpoint-activations"] + extra)
        mlm = built(shape + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                             "--recompute-num-layers", str(n)])
        assert mds.config == mlm.config and mds.config.model.recompute_num_layers == n
        assert _layer_runs(mds.config) == 2 * 4  # each layer forward again in backward
        assert any(line.startswith("megatron-2bw: --checkpoint-activations: every transformer "
                                   f"layer recomputed in backward, in chunks of {n}")
                   and line.endswith("Megatron-LM retired the flag") for line in mds.notes)
    assert _layer_runs(built(shape).config) == 4
    # DeepSpeed's activation checkpointing alone recomputes nothing (as in Megatron-DeepSpeed)
    alone = built(shape + ["--deepspeed", "--deepspeed-activation-checkpointing",
                           "--partition-activations", "--checkpoint-in-cpu"])
    assert _layer_runs(alone.config) == 4
    assert sum("--deepspeed-activation-checkpointing: recomputation runs the engine's own" in n
               or "--partition-activations: " in n or "--checkpoint-in-cpu: " in n
               for n in alone.notes) == 3
    with_ds = built(shape + ["--deepspeed", "--checkpoint-activations"]).notes
    assert not [n for n in with_ds if "retired" in n]  # with --deepspeed: its own flag


def test_full_recomputation_takes_megatrons_default_of_one_layer():
    cfg = built(["--recompute-granularity", "full", "--recompute-method", "uniform"]).config
    assert (cfg.model.recompute_method, cfg.model.recompute_num_layers) == ("uniform", 1)


def test_checkpoint_activations_beside_other_recompute_flags_is_one_line(capsys):
    (line,) = refused(["--checkpoint-activations", "--recompute-granularity", "selective"],
                      capsys)
    assert line == ("pretrain_gpt.py: error: --checkpoint-activations (--recompute-granularity "
                    "full --recompute-method uniform --recompute-num-layers 1) with other "
                    "recompute flags: give one of them")


# -- ZeRO: --zero-stage and the DeepSpeed JSON ---------------------------------------------------
def _ds(tmp_path, zero=None) -> str:
    ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1}
    if zero is not None:
        ds["zero_optimization"] = zero
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    return str(tmp_path / "ds.json")


def test_zero_stage_1_is_the_distributed_optimizer_and_agrees_with_the_json(tmp_path):
    assert built(["--zero-stage", "1"], world=2).config.parallel.distributed_optimizer
    assert not built(["--zero-stage", "0"], world=2).config.parallel.distributed_optimizer
    agreed = built(["--zero-stage=1", "--deepspeed_config", _ds(tmp_path, {"stage": 1}),
                    "--deepspeed"], world=2)
    assert agreed.config.parallel.distributed_optimizer
    assert built(["--zero-stage", "1"], world=2).config == built(
        ["--use-distributed-optimizer"], world=2).config
    for zero, shown in (({"stage": 0}, "zero_optimization.stage 0"),
                        (None, "zero_optimization.stage (absent: DeepSpeed's default) 0")):
        with pytest.raises(ConfigError) as e:
            built(["--zero-stage", "1", "--deepspeed_config", _ds(tmp_path, zero)], world=2)
        assert str(e.value) == (f"--zero-stage 1 disagrees with the DeepSpeed config's {shown}: "
                                "give the same stage in both")
    noted = built(["--zero-stage", "1", "--zero-reduce-scatter", "--zero-contigious-gradients",
                   "--zero-reduce-bucket-size", "500000000"], world=2).notes
    assert sum(n.startswith(("megatron-2bw: --zero-reduce-scatter: ",
                             "megatron-2bw: --zero-contigious-gradients: ",
                             "megatron-2bw: --zero-reduce-bucket-size 500000000: ",
                             "megatron-2bw: --zero-stage 1: the distributed optimizer"))
               for n in noted) == 4


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stages_2_and_3_are_refused_with_what_to_do(stage, capsys):
    (line,) = refused(["--zero-stage", str(stage)], capsys)
    assert line.startswith(f"pretrain_gpt.py: error: --zero-stage {stage}: ZeRO stage {stage} "
                           "(gradients") and line.endswith("use --zero-stage 1 (the distributed "
                                                           "optimizer)")


# -- --train-tokens: the run stops at whichever comes first -------------------------------------
def test_train_tokens_stop_the_run_where_megatron_deepspeeds_loop_does():
    base = ["--global-batch-size", "4", "--seq-length", "16", "--lr-decay-style", "linear"]
    cfg = built(base + ["--train-iters", "10", "--train-tokens", "200"])  # 64 tokens a batch
    assert cfg.config.train.train_iters == 4  # 3 batches hold 192 < 200 tokens: one more
    assert "megatron-2bw: --train-tokens 200: the run stops after iteration 4 (256 tokens of " \
           "64 per iteration), before the 10 iterations given" in cfg.notes
    # the lr still decays over the 10 iterations given, as there
    plain = built(base + ["--train-iters", "10"]).config
    assert [LRSchedule.of(cfg.config)(i) for i in range(4)] == \
        [LRSchedule.of(plain)(i) for i in range(4)]
    assert built(base + ["--train-iters", "10", "--train-tokens", "256"]).config.train \
        .train_iters == 4
    samples = built(base + ["--train-samples", "40", "--train-tokens", "200"]).config
    assert samples.train.train_iters == 4 and samples.optimizer.lr_decay_samples == 40
    late = built(base + ["--train-iters", "3", "--train-tokens", "10000"])
    assert late.config.train.train_iters == 3
    assert "megatron-2bw: --train-tokens 10000: not reached in the 3 iterations given (192 " \
           "tokens)" in late.notes


# -- the rest of the dialect: stated, or refused in one line ---------------------------------------
def _given(flag: str) -> list[str]:
    kw = NOTED[flag][0] if flag in NOTED else NEUTRAL[flag][0]
    if kw.get("action") == "store_true":
        return [flag]
    if "choices" in kw:
        return [flag, kw["choices"][0]]
    return [flag, "2"]


@pytest.mark.parametrize("flag", sorted(compat_mds.NOTED))
def test_a_megatron_deepspeed_selector_is_taken_and_stated(flag):
    argv = _given(flag)
    notes = built(argv).notes
    assert f"megatron-2bw: {' '.join(argv)}: {NOTED[flag][1]}" in notes


def _off_neutral(flag: str) -> list[str]:
    kw, neutral, _ = NEUTRAL[flag]
    if kw.get("action") == "store_true":
        return [flag]
    if "choices" in kw:
        allowed = neutral if isinstance(neutral, tuple) else (neutral,)
        return [flag, next(c for c in kw["choices"] if c not in allowed)]
    return [flag, "3"]


@pytest.mark.parametrize("flag", sorted(compat_mds.NEUTRAL))
def test_a_feature_the_engine_lacks_is_refused_in_one_line_with_what_to_do(flag, capsys):
    argv = _off_neutral(flag)
    if flag in compat_mds.NEUTRAL_WHEN and flag != "--ds-sequence-parallel-fpdt-chunk-size":
        argv += ["--num-experts", "8"]  # a MoE setting: refused with the experts
    elif flag == "--ds-sequence-parallel-fpdt-chunk-size":
        argv += ["--ds-sequence-parallel-fpdt"]
    feature = NEUTRAL[flag][2]
    lines = [x for x in refused(argv, capsys) if " ".join(argv[:2]) in x or flag in x]
    assert len(lines) == 1, lines
    assert f"{feature} is not in this engine; {INSTEAD.get(feature, 'drop')}" in lines[0]


def test_megatron_deepspeeds_dense_scripts_moe_settings_are_taken_with_one_expert(capsys):
    """Its MoE directory's dense scripts pass --num-experts 1 with the MoE settings: no experts,
    no effect (each stated); with 8 experts they are refused with the experts, in one line."""
    moe = ["--moe-expert-parallel-size", "1", "--moe-loss-coeff", "0.01",
           "--moe-train-capacity-factor", "1.0", "--moe-eval-capacity-factor", "1.0",
           "--moe-min-capacity", "4", "--topk", "2"]
    dense = built(["--num-experts", "1"] + moe)
    assert dense.config == built([]).config
    assert [n for n in dense.notes if "no experts" in n] == [
        f"megatron-2bw: {flag}: no experts (--num-experts 1): no effect, as in "
        "Megatron-DeepSpeed" for flag in ("--topk 2", "--moe-loss-coeff 0.01")]
    (line,) = refused(["--num-experts", "8"] + moe, capsys)
    assert line == ("pretrain_gpt.py: error: --num-experts 8, --topk 2, --moe-loss-coeff 0.01: "
                    "mixture of experts is not in this engine; train a dense model (drop the "
                    "MoE flags)")


def test_no_pipeline_parallel_is_one_stage(capsys):
    assert "megatron-2bw: --no-pipeline-parallel: one pipeline stage, as given" in \
        built(["--no-pipeline-parallel"]).notes
    (line,) = refused(["--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"], capsys)
    assert line.endswith("--no-pipeline-parallel needs --pipeline-model-parallel-size 1 (as in "
                         "Megatron-DeepSpeed): drop it to train 2 stages")


def test_with_deepspeed_the_json_clips_as_in_megatron_deepspeed(tmp_path):
    """Megatron-DeepSpeed hands DeepSpeed its optimizer unclipped: DeepSpeed clips by the JSON's
    gradient_clipping (absent: none); without --deepspeed, --clip-grad clips as in Megatron-LM."""
    ds = _ds(tmp_path)
    with_ds = built(["--clip-grad", "1", "--deepspeed", "--deepspeed_config", ds], world=2)
    assert with_ds.config.optimizer.clip_grad == 0.0
    assert any(n.startswith("megatron-2bw: --clip-grad 1: no effect with --deepspeed")
               for n in with_ds.notes)
    assert built(["--clip-grad", "1", "--deepspeed_config", ds], world=2).config.optimizer \
        .clip_grad == 1.0
    (tmp_path / "clip.json").write_text(json.dumps({"train_batch_size": 2,
                                                    "gradient_clipping": 0.5}))
    assert built(["--deepspeed", "--deepspeed_config", str(tmp_path / "clip.json")],
                 world=2).config.optimizer.clip_grad == 0.5


def test_deepspeeds_old_names_of_its_flags_are_taken(tmp_path):
    ds = _ds(tmp_path)
    old = built(["--deepscale", "--deepscale_config", ds], world=2)
    assert old.config == built(["--deepspeed", "--deepspeed_config", ds], world=2).config


@pytest.mark.parametrize("typo,meant", [("--num-layerz", "--num-layers"),
                                        ("--hiden-size", "--hidden-size"),
                                        ("--micro-batch-sise", "--micro-batch-size"),
                                        ("--lr-decay-iter", "--lr-decay-iters"),
                                        ("--train_iters", "--train-iters"),
                                        ("--zero-stag", "--zero-stage")])
def test_a_typo_gets_the_flag_it_meant(typo, meant, capsys):
    assert refused([typo, "1"], capsys) == [f"pretrain_gpt.py: error: unknown flag {typo} (did "
                                            f"you mean {meant}?)"]


@pytest.mark.parametrize("flag", ["--zero-offload", "--bogus", "--query-gpu", "--epochs",
                                  "--pretrained-checkpoint", "--task", "--stage-count"])
def test_a_flag_of_another_vocabulary_gets_no_suggestion(flag, capsys):
    assert refused([flag], capsys) == [f"pretrain_gpt.py: error: unknown flag {flag}"]
