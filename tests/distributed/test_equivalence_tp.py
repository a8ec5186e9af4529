"""Tensor x pipeline x data layouts of GPT and BERT equal the single-process reference
(tools/verify_equivalence.py), without activation recomputation, with selective recomputation
(--recompute-activations: core attention) and with full recomputation of whole layers.

The default run keeps the cheap cases; `-m slow` runs the whole matrix of issue 3
((t,d,w) in {(2,1,1),(2,2,1),(2,2,2)} x gpipe/flush/2bw x GPT/BERT x recompute off/selective/full)."""
import pytest

from megatron_2bw.testing.verify import parse, run

# init std 0.1 (about 1/sqrt(hidden), as test_equivalence_llama.py explains): at Megatron's 0.02
# Adam turns the tensor ranks' reassociation into 7e-6 here (2.4e-5 on another CPU), at 0.1 4e-7
TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 4 --clip-grad 0.3 --init-method-std 0.1").split()


def check(model, schedule, t, d, w, recompute):
    argv = ["--model-type", model, "--schedule", schedule, "--tensor-model-parallel-size", str(t),
            "--pipeline-model-parallel-size", str(d), "--data-parallel-size", str(w),
            "--global-batch-size", str(8 * w)] + TINY
    if recompute == "full":
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    elif recompute:
        argv.append("--recompute-activations")  # selective: core attention
    cfg, _ = parse(argv)
    rep = run(cfg, timeout_minutes=2)
    assert rep.passed(1e-5), rep
    assert rep.tied_equal and rep.replicas_equal and not rep.problems


@pytest.mark.parametrize("model,schedule,t,d,w,recompute", [
    ("gpt", "2bw", 2, 2, 1, "full"),
    ("gpt", "gpipe", 2, 1, 1, False),
    ("bert", "flush", 2, 2, 1, "selective"),
    ("bert", "2bw", 2, 1, 1, "full"),
])
def test_cheap_layouts(model, schedule, t, d, w, recompute):
    check(model, schedule, t, d, w, recompute)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False, "selective", "full"])
@pytest.mark.parametrize("t,d,w", [(2, 1, 1), (2, 2, 1), (2, 2, 2)], ids=["t2", "t2d2", "t2d2w2"])
@pytest.mark.parametrize("schedule", ["gpipe", "flush", "2bw"])
@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_full_matrix(model, schedule, t, d, w, recompute):
    check(model, schedule, t, d, w, recompute)
