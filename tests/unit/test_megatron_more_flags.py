"""More of Megatron-LM's flags (arguments.py, beyond its example scripts): performance, logging and
initialization switches that leave the arithmetic alone are taken and stated in one line; the
features the engine lacks are taken at their neutral value and refused at any other, in one line
with what to do instead; --use-rotary-position-embeddings (Megatron-DeepSpeed's RoPE) is taken
beside --position-embedding-type rope too."""
import pytest

from megatron_2bw.config.build import build_config
from megatron_2bw.config.compat import INSTEAD, NEUTRAL, NOTED
from megatron_2bw.pretrain import build_parser

STATED = [["--use-cpu-initialization"], ["--no-initialization"], ["--no-save-rng"],
          ["--override-opt_param-scheduler"], ["--apply-query-key-layer-scaling"],
          ["--log-progress"], ["--log-batch-size-to-tensorboard"],
          ["--no-log-learnig-rate-to-tensorboard"], ["--timing-log-option", "minmax"],
          ["--num-dataset-builder-threads", "4"], ["--no-scatter-gather-tensors-in-pipeline"],
          ["--no-overlap-p2p-communication"], ["--nccl-communicator-config-path", "nccl.yaml"],
          ["--tp-comm-overlap-cfg", "tp.yaml"], ["--disable-tp-comm-split-ag"],
          ["--no-delay-grad-reduce"]]
# flag and a value off its neutral one -> the feature named in the refusal
REFUSED = [(["--fp32-residual-connection"], "fp32 residual connections"),
           (["--apply-residual-connection-post-layernorm"], "the residual taken after the norm"),
           (["--add-qkv-bias"], "a bias on the QKV projection alone"),
           (["--squared-relu"], "the squared-ReLU MLP"),
           (["--start-weight-decay", "0.01", "--end-weight-decay", "0.1",
             "--weight-decay-incr-style", "linear"], "a weight-decay schedule"),
           (["--init-method-xavier-uniform"], "Xavier-uniform initialization"),
           (["--standalone-embedding-stage"], "Megatron's embedding-only first stage flag")]


@pytest.mark.parametrize("flags", STATED, ids=lambda f: f[0])
def test_a_switch_that_leaves_the_arithmetic_alone_is_taken_and_stated(flags):
    args = build_parser("gpt").parse_args(["--mock-data"] + flags)
    notes = "\n".join(build_config(args, "gpt", 1).notes)
    shown = " ".join(flags)
    assert f"megatron-2bw: {shown}: {NOTED[flags[0]][1]}" in notes


@pytest.mark.parametrize("flags,feature", REFUSED, ids=lambda x: x[0] if isinstance(x, list)
                         else "")
def test_a_feature_the_engine_lacks_is_refused_in_one_line_with_what_to_do(flags, feature,
                                                                            capsys):
    with pytest.raises(SystemExit) as e:
        build_parser("gpt").parse_args(["--mock-data"] + flags)
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert f"{feature} is not in this engine; {INSTEAD[feature]}" in lines[0]
    assert flags[0] in lines[0]


def test_their_neutral_values_are_taken():
    neutral = ["--weight-decay-incr-style", "constant",
               "--position-embedding-type", "rope", "--use-rotary-position-embeddings"]
    args = build_parser("gpt").parse_args(["--mock-data"] + neutral)
    built = build_config(args, "gpt", 1)
    assert built.config.model.position_embedding_type == "rope"
    assert "megatron-2bw: --use-rotary-position-embeddings: RoPE (= --position-embedding-type " \
           "rope)" in "\n".join(built.notes)


def test_every_refused_feature_says_what_to_do_instead():
    features = {feature for _kw, _neutral, feature in NEUTRAL.values()}
    assert {f for _flags, f in REFUSED} <= set(INSTEAD) & features


def test_lr_warmup_init_is_where_megatrons_warmup_starts_for_every_lr_class():
    """Megatron's scheduler: init + (max - init) x step / warmup steps, the same init for the
    decoupled class (--decoupled-lr); then the decay as before."""
    from megatron_2bw.optim.lr import LRSchedule
    args = build_parser("gpt").parse_args(
        ["--mock-data", "--lr", "1e-3", "--min-lr", "1e-5", "--lr-warmup-iters", "4",
         "--lr-warmup-init", "1e-4", "--lr-decay-style", "linear", "--train-iters", "12",
         "--decoupled-lr", "5e-3"])
    cfg = build_config(args, "gpt", 1).config
    sched = LRSchedule(cfg.optimizer, cfg.train.train_iters)
    for it in range(4):
        assert sched(it) == pytest.approx(1e-4 + (1e-3 - 1e-4) * (it + 1) / 4)
        assert sched.decoupled(it) == pytest.approx(1e-4 + (5e-3 - 1e-4) * (it + 1) / 4)
    assert sched(11) == pytest.approx(1e-5)  # decayed to --min-lr at --train-iters
    plain = LRSchedule(build_config(build_parser("gpt").parse_args(
        ["--mock-data", "--lr", "1e-3", "--lr-warmup-iters", "4"]), "gpt", 1).config.optimizer,
        12)
    assert plain(0) == pytest.approx(1e-3 / 4)  # default 0: as before


def test_a_negative_lr_warmup_init_is_one_line():
    from megatron_2bw.config import ConfigError
    args = build_parser("gpt").parse_args(["--mock-data", "--lr-warmup-init=-1e-4"])
    with pytest.raises(ConfigError, match=r"--lr-warmup-init must be >= 0, got -0.0001"):
        build_config(args, "gpt", 1)
