"""Batch-size ramps to the end (issue 49, point 4), on real gloo processes: a GPT-3-style flag set
with --rampup-batch-size (and one with --step-batch-size-schedule, token thresholds with
suffixes) crosses two batch-size changes in one run and equals the single-process reference at
every iteration (tools/verify_equivalence.py's judge: every parameter and every loss, rtol 1e-5;
2bw, flush, gpipe at d=2, w=2 for some); an engine that keeps one m fails the same judge; a
stop and resume between the changes is bitwise (torch_dist and torch), and the checkpoint
records the samples really consumed.

The ramp (micro batch 2): --rampup-batch-size 4 4 24 --global-batch-size 12 gives, by
Megatron's arithmetic, the global batches 4 4 4 8 8 12 12 (m = 2 2 2 4 4 6 6 per replica) and
with --data-parallel-size 2 --rampup-batch-size 8 8 48 --global-batch-size 24 the batches
8 8 8 16 16 24 24 (m = 2 2 2 4 4 6 6): changes at iterations 4 and 6.
"""
import os
import re
import shlex
import tempfile

import pytest
import torch

from matrix import matrix
from megatron_2bw.checkpoint.api import LATEST, rank_dir
from megatron_2bw.checkpoint.dist.load import read_common
from megatron_2bw.checkpoint.files import iteration_dir
from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.testing.verify import main, parse, run
from test_resume import make_cfg, newest_weights
from test_resume import run as train_run

# the GPT-3 example's training flags (examples/gpt3/train_gpt3_175b_distributed.sh of
# NVIDIA/Megatron-LM), sizes and iterations changed
GPT3 = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 7 --weight-decay 0.1 "
        "--adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 "
        "--lr 6.0e-3 --lr-decay-style cosine --min-lr 6.0e-4 --lr-warmup-fraction .1 "
        "--lr-decay-iters 6 --timeout-minutes 1")
RAMP = {1: "--rampup-batch-size 4 4 24 --global-batch-size 12",
        2: "--rampup-batch-size 8 8 48 --global-batch-size 24"}
# the same batches by token thresholds (seq 16: 0.192K tokens = 12 samples, 0.448K = 28)
STEP = {1: '--step-batch-size-schedule "0:4 0.192K:8 0.448K:12"',
        2: '--step-batch-size-schedule "0:8 0.384K:16 0.896K:24"'}


def judge(schedule, w, ramp, *extra, engine_class=PipelineEngine):
    cfg, _ = parse(shlex.split(f"--schedule {schedule} --pipeline-model-parallel-size 2 "
                               f"--data-parallel-size {w} {GPT3} {ramp}") + list(extra))
    plan = cfg.batch_plan
    assert [plan.m(t) for t in range(7)] == [2, 2, 2, 4, 4, 6, 6], plan
    return run(cfg, timeout_minutes=1, engine_class=engine_class)


@pytest.mark.parametrize("schedule,w,optimizer", matrix(
    [(s, w, o) for s in ("2bw", "flush", "gpipe") for w in (1, 2) for o in ("adam", "sgd")],
    default=[("2bw", 1, "adam"), ("2bw", 2, "sgd"), ("flush", 2, "adam"), ("gpipe", 1, "sgd")]))
def test_a_rampup_equals_the_reference_at_every_iteration(schedule, w, optimizer):
    """SGD (no clipping) moves by the gradient's scale: a mean over the wrong count of
    microbatches or replicas shows; Adam with clipping at 1.0 (the GPT-3 flags) the rest."""
    extra = ["--optimizer", optimizer] + (["--clip-grad", "0", "--lr", "0.05"]
                                          if optimizer == "sgd" else [])
    rep = judge(schedule, w, RAMP[w], *extra)
    assert rep.passed(1e-5) and rep.tied_equal and rep.replicas_equal, rep


@pytest.mark.parametrize("schedule,w", matrix(
    [("2bw", 1), ("2bw", 2), ("flush", 1), ("gpipe", 2)],
    default=[("2bw", 2), ("flush", 1), ("gpipe", 2)]))
def test_a_step_schedule_equals_the_reference_at_every_iteration(schedule, w, capsys):
    """Through tools/verify_equivalence.py's command line (`main`), which takes the flags."""
    argv = shlex.split(f"--schedule {schedule} --pipeline-model-parallel-size 2 "
                       f"--data-parallel-size {w} {GPT3} {STEP[w]}")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"d=2 w={w} m=2->4->6 iters=7" in out and out.rstrip().endswith("PASS"), out


class OneMicrobatchCount(PipelineEngine):
    """A broken ramp, defined here and passed in: every segment runs the final m, whatever the
    batch plan says (the data and the mean then follow the wrong batches)."""

    def start(self, num_batches=None):
        super().start(num_batches)
        if self.m != self.eval_m:
            self.m = self.eval_m
            self.schedule = type(self.schedule)(self.kind, self.num_stages, self.m,
                                                self.schedule.num_batches,
                                                self.schedule.first_batch)
            self._plan_receives(self.schedule)
            self.stepper.reduction.reset(self.m)


def test_the_judge_catches_an_engine_that_keeps_one_m():
    rep = judge("2bw", 1, RAMP[1], engine_class=OneMicrobatchCount)
    assert not rep.passed(1e-5) and rep.max_loss_diff > 1e-3, rep


# -- stop and resume between the changes -------------------------------------------------------
def ramp_cfg(ramp, fmt, *flags):
    """test_resume's run (2 processes, d=2, dropout on, 2bw) with the ramp, 7 iterations (its
    --global-batch-size 8 replaced by the ramp's)."""
    final = "" if "--global-batch-size" in ramp else " --global-batch-size 12"
    return make_cfg(shlex.split(ramp + final) + ["--pipeline-schedule", "2bw",
                                                 "--ckpt-format", fmt, "--train-iters", "7",
                                                 *flags])


@pytest.mark.parametrize("ramp,fmt", matrix(
    [(RAMP[1], "torch_dist"), (RAMP[1], "torch"), (STEP[1], "torch_dist")],
    default=[(RAMP[1], "torch_dist"), (RAMP[1], "torch"), (STEP[1], "torch_dist")]))
def test_a_stop_between_the_changes_resumes_bitwise(ramp, fmt):
    """Stopped after iteration 4 (the second stretch: global batch 8, m=4), resumed: the losses
    and both weight versions equal the uninterrupted run's through the change at iteration 6."""
    with tempfile.TemporaryDirectory() as d:
        full = train_run(ramp_cfg(ramp, fmt, "--save", f"{d}/a"), f"{d}/full")
        first = train_run(ramp_cfg(ramp, fmt, "--save", f"{d}/b", "--save-interval", "2",
                                   "--exit-interval", "4"), f"{d}/first", log=f"{d}/log")
        assert len(first) == 4 and first == full[:4]
        log = open(f"{d}/log.1").read()  # the reporting rank's: the real sums, 4 4 4 8
        assert re.search(r"iteration\s+3/\s*7 \| consumed samples:?\s+12 \|", log), log
        assert re.search(r"iteration\s+4/\s*7 \| consumed samples:?\s+20 \|", log), log
        assert int(open(os.path.join(f"{d}/b", LATEST)).read()) == 4
        if fmt == "torch_dist":  # the samples really consumed: 4 + 4 + 4 + 8
            assert read_common(iteration_dir(f"{d}/b", 4))["consumed_samples"] == 20
        else:
            payload = torch.load(os.path.join(rank_dir(f"{d}/b", 4, 0, 0, 2),
                                              "model_optim_rng.pt"), weights_only=True)
            assert payload["consumed_samples"] == 20
        rest = train_run(ramp_cfg(ramp, fmt, "--save", f"{d}/b", "--load", f"{d}/b"),
                         f"{d}/rest", log=f"{d}/log")
        assert rest == full[4:], (rest, full[4:])
        assert "run summary | iterations 3 (4->7) | samples 32 |" in open(f"{d}/log.1").read()
        for a, b in zip(newest_weights(f"{d}/a"), newest_weights(f"{d}/b")):
            assert a["iteration"] == b["iteration"] == 7
            assert torch.equal(a["newest"], b["newest"]) and torch.equal(a["previous"],
                                                                         b["previous"])
