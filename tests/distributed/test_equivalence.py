"""Every schedule on real gloo processes equals its single-process reference (docs/ARCHITECTURE.md section 1).

Each case runs tools/verify_equivalence.py's logic: spawn t*d*w ranks, train, compare every
parameter with plain PyTorch training (gpipe/flush) or the delayed-update reference (2bw).
"""
from itertools import product

import pytest

from matrix import matrix
from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.testing.verify import main, parse, report, run

TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --lr 3e-3 --train-iters 5 --timeout-minutes 1").split()


def flags(schedule, d, w, *extra, m=4):
    return (["--schedule", schedule, "--pipeline-model-parallel-size", str(d),
             "--data-parallel-size", str(w), "--global-batch-size", str(2 * m * w)]
            + TINY + list(extra))


@pytest.mark.parametrize("schedule,d,w", matrix(
    product(["gpipe", "flush", "2bw"], [2, 4], [1, 2]),
    default=[("gpipe", 2, 1), ("flush", 2, 2), ("2bw", 4, 1), ("2bw", 2, 2)]))
def test_adam_with_clipping_matches_reference(schedule, d, w, capsys):
    cfg, _ = parse(flags(schedule, d, w, "--optimizer", "adam", "--clip-grad", "0.3"))
    rep = run(cfg, timeout_minutes=1)
    assert rep.passed(1e-5), rep
    assert rep.clipped_steps > 0, "clipping must be active for this test to mean anything"
    assert rep.tied_equal and rep.replicas_equal


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_sgd_with_lr_schedule_matches_reference(schedule):
    cfg, _ = parse(flags(schedule, 2, 2, "--optimizer", "sgd", "--lr", "0.05",
                         "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
                         "--clip-grad", "0", "--weight-decay", "0.1"))
    assert run(cfg, timeout_minutes=1).passed(1e-5)


def test_untied_output_layer_and_pp_inner_rank_order():
    cfg, _ = parse(flags("2bw", 2, 2, "--untie-embeddings-and-output-weights",
                         "--rank-order", "tp-pp-dp"))
    assert run(cfg, timeout_minutes=1).passed(1e-5)


def test_2bw_with_more_microbatches_than_stages():
    cfg, _ = parse(flags("2bw", 4, 1, m=6))
    assert run(cfg, timeout_minutes=1).passed(1e-5)


class OneVersion2BW(PipelineEngine):
    """A broken 2BW, defined here and passed in: every step also overwrites the version that
    in-flight microbatches still use, behind autograd's version counter (`.data`), so their
    backwards silently see the newest weights: one live version instead of two."""

    def _step(self, a):
        super()._step(a)
        w = self.weights
        newest = w.slots[self.kind.step_writes_slot(a.batch)]
        for slot in w.slots:
            if slot is not newest:
                slot.data.copy_(newest)


def test_checker_catches_a_broken_2bw(capsys):
    """The comparison with the reference must fail for a 2BW that keeps one weight version."""
    cfg, _ = parse(flags("2bw", 2, 1))
    rep = run(cfg, timeout_minutes=1, engine_class=OneVersion2BW)
    assert not rep.passed(1e-5) and rep.max_rel_diff > 1e-3, rep
    assert report(cfg, rep, 1e-5) == 1
    out = capsys.readouterr().out
    assert out.rstrip().endswith("FAIL") and "max relative parameter difference" in out


def test_tool_passes_and_prints_the_difference(capsys):
    assert main(flags("2bw", 2, 1)) == 0
    out = capsys.readouterr().out
    assert "max relative parameter difference" in out and "PASS" in out


@pytest.mark.parametrize("schedule", ["2bw", "gpipe"])
def test_evaluation_between_batches_keeps_training_exact(schedule):
    """eval_batch runs between two 2BW windows while the next batch's forwards are in flight:
    its losses equal the reference's on the newest weights and training stays exact."""
    cfg, _ = parse(flags(schedule, 2, 2))
    rep = run(cfg, timeout_minutes=1, eval_interval=2)
    assert rep.passed(1e-5) and not rep.problems, rep
