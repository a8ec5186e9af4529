"""A slow rank is named by the straggler report, and a non-finite gradient on one stage stops the
run naming that stage, with the last checkpoint kept and loadable (issue 21). Faults come from
test hooks (tests/fault_hooks.py: SlowStage, PoisonGradient) passed to training.train."""
import math
import os
import re

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from fault_hooks import PoisonGradient, SlowStage
from megatron_2bw.checkpoint.api import LATEST
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.faults import NumericsError
from megatron_2bw.training.observe.logger import parse_line
from megatron_2bw.training.observe.straggler import rank_times, straggler_report
from megatron_2bw.training.reliability import check_numerics
from megatron_2bw.training.spawn import spawn
from test_resume import _worker, make_cfg, newest_weights, run

STRAGGLER = re.compile(r"^straggler at iteration (\d+): rank (\d) \(stage (\d)/2")


def test_a_slow_stage_is_named_within_one_log_interval(tmp_path):
    d = str(tmp_path)
    # wide margins, as wall-clock timers under load need: a stage about 80 ms per iteration
    # (more on busy cores) is named only above 3x the other; from iteration 5 on, rank 0 sleeps
    # 0.5 s in each forward (about 1.5 s more per iteration) and stays far above that
    cfg = make_cfg(["--train-iters", "8", "--log-interval", "2", "--log-straggler",
                    "--straggler-threshold", "200"])
    run(cfg, f"{d}/l", hooks=SlowStage(rank=0, iteration=5, seconds=0.5), log=f"{d}/log")
    lines = open(f"{d}/log.1").read().splitlines()       # the reporting rank: the last stage
    named = [tuple(map(int, m.groups())) for m in map(STRAGGLER.match, lines) if m]
    assert named == [(6, 0, 0), (8, 0, 0)], "\n".join(lines)  # sleeps from iteration 5 on
    logged = dict(filter(None, map(parse_line, lines)))
    assert [logged[it]["slowest rank"] for it in (6, 8)] == [0, 0]
    assert logged[8]["compute ms per stage"][0] > 2 * logged[8]["compute ms per stage"][1]
    assert logged[8]["wait ms per stage"][1] > logged[8]["wait ms per stage"][0], \
        "the fast stage waits for the slow one"


def test_straggler_peers_are_the_replicas_of_a_stage_when_there_are_some():
    timers = {"forward": 0.02, "backward": 0.04, "optimizer": 0.01, "p2p": 0.03,
              "all-reduce": 0.01}
    assert rank_times(timers, 2) == pytest.approx([35.0, 20.0])  # ms per iteration
    one = ProcessGrid(1, 2, 1)          # one replica: the stages are compared with each other
    fields, line = straggler_report([[10.0, 5.0], [25.0, 1.0]], one, 20.0, 7)
    assert fields["slowest rank"] == 1 and fields["slowest % above median"] == pytest.approx(150)
    assert line.startswith("straggler at iteration 7: rank 1 (stage 1/2, data-parallel replica "
                           "0, tensor rank 0) computes 25.0 ms per iteration, 150% above the "
                           "median of all ranks")
    assert straggler_report([[10.0, 5.0], [25.0, 1.0]], one, 20.0, 7, name=False)[1] is None
    two = ProcessGrid(1, 2, 2)          # tp-dp-pp: ranks 0, 1 are stage 0; 2, 3 stage 1
    balanced = [[10.0, 9.0], [10.0, 9.0], [20.0, 1.0], [20.0, 1.0]]
    fields, line = straggler_report(balanced, two, 20.0, 7)
    assert line is None, "a costlier stage is not a straggler among replicas"
    assert fields["compute ms per stage"] == [10.0, 20.0] and fields["wait ms per stage"] == \
        [9.0, 1.0]
    fields, line = straggler_report(balanced[:3] + [[30.0, 1.0]], two, 20.0, 7)
    assert fields["slowest rank"] == 3 and "rank 3 (stage 1/2, data-parallel replica 1" in line
    assert "50% above the median of its stage's ranks (20.0 ms" in line


# iteration 5: found one batch behind, after iteration 6 ran; iteration 6: found before its
# checkpoint is written (a diverged step is never saved)
@pytest.mark.parametrize("rank,value,iteration", [(0, float("nan"), 5), (1, float("inf"), 6)])
def test_nonfinite_gradient_on_one_stage_stops_the_run_naming_it(tmp_path, rank, value,
                                                                 iteration):
    d = str(tmp_path)
    cfg = make_cfg(["--train-iters", "8", "--save", d, "--save-interval", "2"])
    with pytest.raises(ProcessRaisedException,
                       match=rf"NumericsError: gradient norm is not finite at iteration "
                             rf"{iteration} on rank \d \(stage \d/2.*\) with fp32: the gradients "
                             rf"of stage {rank} \(of 2\) are not finite; .* or resume from "
                             rf"iteration 4 in {d}"):
        run(cfg, f"{d}/l", hooks=PoisonGradient(rank=rank, iteration=iteration, value=value))
    assert open(os.path.join(d, LATEST)).read().strip() == "4", "the last good checkpoint"
    for state in newest_weights(d):
        assert state["iteration"] == 4 and torch.isfinite(state["newest"]).all()
    resumed = run(make_cfg(["--train-iters", "6", "--load", d]), f"{d}/r")
    assert len(resumed) == 2 and all(math.isfinite(x) for x in resumed)


def test_fp16_skips_a_nonfinite_gradient_and_goes_on(tmp_path):
    d = str(tmp_path)
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    losses = run(make_cfg(["--train-iters", "5", "--fp16", "--log-interval", "5",
                           "--initial-loss-scale", "65536",  # (Megatron's 2^32 overflows first)
                           "--tensorboard-dir", f"{d}/tb"]), f"{d}/l",
                 hooks=PoisonGradient(rank=0, iteration=3, value=float("inf")), log=f"{d}/log")
    (it, fields), = filter(None, map(parse_line, open(f"{d}/log.1")))
    assert it == 5 and fields["number of skipped iterations"] == 1 and \
        math.isfinite(fields["lm loss"])
    # Megatron's: the skipped iteration (3) has no lm loss, and the line's is the mean of the rest
    acc = EventAccumulator(f"{d}/tb", size_guidance={"scalars": 0})
    acc.Reload()
    board = [(e.step, e.value) for e in acc.Scalars("lm loss")]
    assert [step for step, _ in board] == [1, 2, 4, 5]
    assert [v for _, v in board] == pytest.approx(losses[:2] + losses[3:], rel=1e-6)
    assert fields["lm loss"] == pytest.approx(sum(v for _, v in board) / 4, rel=1e-3)


def test_without_the_check_a_nonfinite_gradient_trains_on(tmp_path):
    d = str(tmp_path)
    cfg = make_cfg(["--train-iters", "6", "--no-check-for-nan-in-loss-and-grad"])
    spawn(_worker, 2, args=(cfg, f"{d}/l", PoisonGradient(rank=0, iteration=3)),
          timeout_minutes=1)
    for r in range(2):
        losses = torch.load(f"{d}/l.{r}")
        assert all(math.isfinite(x) for x in losses[:3]) and math.isnan(losses[-1])


def test_numerics_message_names_the_loss_and_every_nonfinite_stage():
    grid = ProcessGrid(1, 4, 1, rank=3)
    check_numerics(None, grid, "fp32")
    check_numerics((6, 2.5, []), grid, "bf16")
    check_numerics((6, float("nan"), [0, 3]), grid, "fp16")  # fp16 skips, never stops here
    with pytest.raises(NumericsError) as e:
        check_numerics((6, float("nan"), [1, 3]), grid, "bf16", "iteration 6 in /ck")
    assert str(e.value) == (
        "loss is nan at iteration 7 on rank 3 (stage 3/4, data-parallel replica 0, tensor rank "
        "0) with bf16: the gradients of stages 1, 3 (of 4) are not finite; lower --lr, add "
        "--clip-grad, use --fp16 loss scaling, or resume from iteration 6 in /ck")
