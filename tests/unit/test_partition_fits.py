"""Partitions that fit: where the time-balanced stage split puts more on a stage than its memory
holds, the planner takes the fastest split whose every stage fits (`partition_within`), says so,
and prints it as --pipeline-partition, which the engine's memory accounting and runs honour."""
import io
import itertools
import json
import random

import pytest

from megatron_2bw.config import ConfigError
from megatron_2bw.models.partition import partition, partition_within
from megatron_2bw.planner import PlanError
from megatron_2bw.planner.cli import run as plan_run
from megatron_2bw.planner.topology import GB
from test_planner_grad_buffers import _auto_plan


def _slowest(costs, bounds):
    return max(sum(costs[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1))


def _brute(costs, d, fits):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), d - 1):
        b = [0, *cuts, len(costs)]
        if all(fits(s, b[s], b[s + 1]) for s in range(d)):
            if best is None or _slowest(costs, b) < best - 1e-12:
                best = _slowest(costs, b)
    return best


def test_the_split_is_the_fastest_whose_stages_fit():
    """Against every split of small random problems whose `fits` holds for any part of a range
    and at any later stage (memory: later stages hold fewer microbatches): the same slowest
    stage, every stage fitting, None exactly when no split fits; with nothing over memory, the
    time-balanced optimum."""
    rng = random.Random(7)
    found = none = 0
    for _ in range(3000):
        n = rng.randint(1, 9)
        d = rng.randint(1, n)
        costs = [rng.choice([0, 1, 2, 3, 5, 8]) * rng.random() for _ in range(n)]
        size = [rng.randint(1, 5) for _ in range(n)]
        room = sorted(rng.randint(2, 14) for _ in range(d))  # later stages: more room

        def fits(s, lo, hi):
            return sum(size[lo:hi]) <= room[s]
        want, got = _brute(costs, d, fits), partition_within(costs, d, fits)
        if want is None:
            assert got is None
            none += 1
            continue
        found += 1
        assert got[0] == 0 and got[-1] == n and len(got) == d + 1
        assert all(got[s] < got[s + 1] and fits(s, got[s], got[s + 1]) for s in range(d))
        assert _slowest(costs, got) == pytest.approx(want, abs=1e-9)
        free = partition_within(costs, d, lambda s, lo, hi: True)
        assert _slowest(costs, free) == pytest.approx(_slowest(costs, partition(costs, d)))
    assert found > 1000 and none > 100


PAPER_SPACE = ("--model gpt-3.8b --num-nodes 8 --gpus-per-node 8 --gpu-memory-gb 16 "
               "--inter-node-bandwidth-gbps 25 --global-batch-size 512 --fp16 --tensor-sizes 1 "
               "--distributed-optimizer off --sequence-parallel off --schedules 2bw --top 1 "
               "--json").split()


def test_gpt_3_8b_on_16_gb_gpus_runs_faster_on_a_split_that_fits():
    """GPT-3.8B in the paper's space: balanced in time, d=8 does not fit and d=16 is the best
    (the paper's pick); on a split that fits, d=8 does, faster. tools/plan.py says why, prints
    the split as --pipeline-partition, and the engine's own memory accounting of a run with
    those flags (`memory_check.stage_estimates`, on the config's partition) is the planner's."""
    from megatron_2bw.config.build import build_config
    from megatron_2bw.planner.memory_check import stage_estimates
    from megatron_2bw.pretrain import build_parser
    runs = {}
    for how in ("balanced", "auto"):
        out = io.StringIO()
        assert plan_run(PAPER_SPACE + ["--partition", how], out) == 0
        runs[how] = json.loads(out.getvalue())
    balanced, fitted = runs["balanced"], runs["auto"]
    assert balanced["chosen"]["pipeline"] == 16 and not balanced["partition"]
    chosen = fitted["chosen"]
    assert chosen["pipeline"] == 8
    assert chosen["samples_per_s"] > balanced["chosen"]["samples_per_s"]
    assert fitted["partition"].startswith(f"stage partition {chosen['partition']} balances time")
    assert "the time-balanced one does not" in fitted["partition"]
    bounds = ",".join(str(b) for b in chosen["partition"])
    assert f"--pipeline-partition {bounds}" in fitted["flags"]
    usable = fitted["topology"]["gpu_memory_gb"] * (
        1 - fitted["topology"]["memory_reserve_fraction"])
    # the GPT-2 vocabulary the planner's gpt-3.8b has (--mock-data's is smaller); dropout 0.1
    # in both (tools/plan.py plans the masks of pretrain's default dropout)
    argv = ["--model", "gpt-3.8b", "--fp16", "--mock-data", "--vocab-size", "50304"] + \
        fitted["flags"].split()
    cfg = build_config(build_parser("gpt").parse_args(argv), "gpt", 64).config
    assert cfg.parallel.partition == tuple(chosen["partition"])
    engine = [m["total"] / GB for m in stage_estimates(cfg, 64)]
    assert max(engine) <= usable
    assert engine == pytest.approx(chosen["memory_gb_per_stage"], rel=1e-4)


def test_pipeline_partition_reaches_the_config_and_bad_ones_are_one_line(tmp_path, capsys):
    from megatron_2bw.config.build import build_config
    from megatron_2bw.pretrain import build_parser
    shape = ("--mock-data --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
             "--seq-length 32 --vocab-size 512 --global-batch-size 8 "
             "--pipeline-model-parallel-size 2").split()
    cfg = build_config(build_parser("gpt").parse_args(shape + ["--pipeline-partition", "0,1,6"]),
                       "gpt", 2).config
    assert cfg.parallel.partition == (0, 1, 6)
    with pytest.raises(SystemExit):
        build_parser("gpt").parse_args(shape + ["--pipeline-partition", "0,x,6"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--pipeline-partition" in err and "comma-separated stage boundaries" in err
    for bad in ("0,6", "0,3,3,6", "0,4,5"):
        with pytest.raises(ConfigError, match=r"stage partition .* must rise strictly from 0 "
                                              r"to 6 in 2 steps"):
            build_config(build_parser("gpt").parse_args(shape + ["--pipeline-partition", bad]),
                         "gpt", 2)
    with pytest.raises(PlanError, match="^--pipeline-partition 0,1,6 fixes the stage partition, "
                                        "which --auto-plan chooses"):
        _auto_plan(shape + ["--pipeline-partition", "0,1,6"], 2, tmp_path, 1.0)
