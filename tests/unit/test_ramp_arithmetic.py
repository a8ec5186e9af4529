"""Batch-size ramps (issue 49, point 4): Megatron's num-microbatches arithmetic, against the real
megatron-core calculator (--rampup-batch-size, --decrease-batch-size-if-needed) and Megatron-LM's
StepBatchsize calculator written out from its source (megatron/core/num_microbatches_calculator.py
of NVIDIA/Megatron-LM, PR #4411: not in megatron-core 0.16); --train-samples counted as
Megatron's update_train_iters counts; the lr against megatron-core's OptimizerParamScheduler
stepped by each batch's samples; the one-line refusals; the data order; the planner and the
memory check sized for the largest batch."""
import shlex

import pytest

from megatron_2bw.config import ConfigError
from megatron_2bw.config.build import build_config
from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.pretrain import build_parser
from megatron_2bw.schedule.kinds import schedule_kind

calculator = pytest.importorskip("megatron.core.num_microbatches_calculator")
scheduler = pytest.importorskip("megatron.core.optimizer_param_scheduler")

TINY = "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16"


def built(flags, world=1):
    args = build_parser("gpt").parse_args(TINY.split() + shlex.split(flags))
    return build_config(args, "gpt", world)


def megatron_trajectory(calc, iterations, micro, dp):
    """[(consumed before, running global batch, m)] of Megatron's training loop: update at the
    consumed samples, train, consume micro x dp x m (training.py)."""
    out, consumed = [], 0
    for _ in range(iterations):
        calc.update(consumed, consistency_check=False)
        out.append((consumed, calc.get_current_running_global_batch_size(), calc.get()))
        consumed += calc.get() * micro * dp
    return out


@pytest.mark.parametrize("start,inc,samples,final,micro,dp,decrease", [
    (4, 4, 24, 12, 2, 1, False), (16, 16, 5859375, 1536, 1, 1, False),
    (16, 16, 5859375, 1536, 1, 8, False), (8, 4, 100, 40, 2, 2, False),
    (6, 3, 50, 30, 2, 2, True), (16, 16, 5859375, 1536, 1, 12, True),
    (4, 4, 0, 12, 1, 1, False), (12, 4, 30, 12, 1, 1, False)])
def test_rampup_follows_megatron_cores_calculator(start, inc, samples, final, micro, dp,
                                                  decrease):
    cfg = built(f"--rampup-batch-size {start} {inc} {samples} --global-batch-size {final} "
                f"--micro-batch-size {micro} --data-parallel-size {dp} --train-iters 5000"
                + " --decrease-batch-size-if-needed" * decrease, world=dp).config
    real = calculator.RampupBatchsizeNumMicroBatchesCalculator(
        final, micro, dp, decrease, 1, start, inc, samples) if (final > start and samples) \
        else calculator.ConstantNumMicroBatchesCalculator(final, micro, dp, decrease, 1)
    plan = cfg.batch_plan
    for t, (consumed, batch, m) in enumerate(megatron_trajectory(real, 5000, micro, dp)):
        assert (plan.consumed(t), plan.batch(t), plan.m(t)) == (consumed, batch, m), t
        assert (cfg.global_batch_at(consumed), cfg.num_microbatches_at(consumed)) == (batch, m)
    assert cfg.num_microbatches == final // (micro * dp)  # the largest: what memory sizes for
    assert plan.ramps == (final > start and samples > 0)


def megatron_step_batch(schedule, seq, consumed):
    """StepBatchsizeNumMicroBatchesCalculator._get_batch_size_for_samples, with its
    _parse_numeric_value and tokens // seq_length."""
    def number(text):
        text = text.strip().upper()
        for suffix, scale in (("T", 10 ** 12), ("B", 10 ** 9), ("M", 10 ** 6), ("K", 10 ** 3)):
            if text.endswith(suffix):
                return int(float(text[:-1]) * scale)
        return int(float(text))
    table = sorted((number(a) // seq, number(b)) for a, b in
                   (e.split(":", 1) for e in schedule.replace(",", " ").split()))
    batch = table[0][1]
    for threshold, b in table:
        if consumed < threshold:
            break
        batch = b
    return batch


@pytest.mark.parametrize("schedule,micro,dp", [
    ("0:4 0.128K:8 0.256K:12", 2, 1), ("0:16 2.4B:320 4.8B:624 7.2B:928", 1, 16),
    ("0.256K:8,0:4", 2, 2), ("0:8 1M:8 2M:16", 2, 1)])
def test_step_schedule_follows_megatron_lms_calculator(schedule, micro, dp):
    seq = 16
    cfg = built(f'--step-batch-size-schedule "{schedule}" --micro-batch-size {micro} '
                f"--data-parallel-size {dp} --train-iters 10", world=dp).config
    plan, consumed = cfg.batch_plan, 0
    for t in range(3000):
        batch = megatron_step_batch(schedule, seq, consumed)
        assert (plan.consumed(t), plan.batch(t), plan.m(t)) == (consumed, batch,
                                                                 batch // (micro * dp)), t
        consumed += batch
    assert cfg.global_batch_size == max(int(float(e.split(":")[1])) for e in
                                        schedule.replace(",", " ").split())


def megatron_train_iters(calc, final, samples, ramp_samples=None):
    """Megatron's update_train_iters (training.py): the rampup form before PR #4411 (ramp phase,
    then whole final batches), the step-schedule form after it."""
    iterations = consumed = 0
    if ramp_samples is not None:
        while consumed <= ramp_samples and consumed <= samples:
            calc.update(consumed, consistency_check=False)
            consumed += calc.get_current_global_batch_size()
            iterations += 1
        if samples > consumed:
            iterations += (samples - consumed) // final
        return iterations
    while consumed < samples:
        consumed += calc(consumed)
        iterations += 1
    return iterations


@pytest.mark.parametrize("samples", [1, 5, 16, 28, 29, 64, 1000])
def test_train_samples_are_counted_as_megatron_counts_them(samples):
    ramp = built(f"--rampup-batch-size 4 4 24 --global-batch-size 12 --micro-batch-size 2 "
                 f"--train-samples {samples}").config
    real = calculator.RampupBatchsizeNumMicroBatchesCalculator(12, 2, 1, False, 1, 4, 4, 24)
    assert ramp.train.train_iters == max(1, megatron_train_iters(real, 12, samples, 24))
    schedule = '"0:4 0.128K:8 0.256K:12"'
    step = built(f"--step-batch-size-schedule {schedule} --micro-batch-size 2 "
                 f"--train-samples {samples}").config
    want = megatron_train_iters(lambda c: megatron_step_batch(schedule.strip('"'), 16, c), 12,
                                samples)
    assert step.train.train_iters == want
    assert ramp.optimizer.lr_decay_samples == samples  # Megatron's default decay span


@pytest.mark.parametrize("flags,warmup,decay", [
    ("--train-samples 200 --lr-warmup-samples 10 --lr-decay-samples 150", 10, 150),
    ("--train-samples 200 --lr-warmup-fraction 0.1", 20, 200),
    ("--train-iters 20 --lr-decay-iters 15 --lr-warmup-iters 2", 2 * 12, 15 * 12),
    ("--train-iters 20 --lr-warmup-fraction 0.05", 0.05 * 20 * 12, 20 * 12)])
@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_the_lr_follows_consumed_samples_as_megatrons_scheduler(flags, warmup, decay, style):
    cfg = built(f"--rampup-batch-size 4 4 24 --global-batch-size 12 --micro-batch-size 2 "
                f"--lr 0.1 --min-lr 0.01 --lr-warmup-init 0.001 --lr-decay-style {style} "
                + flags).config

    class Optimizer:
        param_groups = [{}]
    real = scheduler.OptimizerParamScheduler(
        Optimizer(), init_lr=0.001, max_lr=0.1, min_lr=0.01, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
        wd_incr_steps=decay, wd_incr_style="constant")
    lr, plan = LRSchedule.of(cfg), cfg.batch_plan
    seen = set()
    for t in range(cfg.train.train_iters):
        real.step(increment=plan.batch(t))  # Megatron's increment: m x micro x dp
        seen.add(plan.batch(t))
        assert lr(t) == pytest.approx(Optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15), t
    assert seen == {4, 8, 12}


@pytest.mark.parametrize("flags,message", [
    ("--rampup-batch-size 2 2 24 --global-batch-size 12 --micro-batch-size 1 "
     "--pipeline-model-parallel-size 4 --pipeline-schedule 2bw --num-layers 4",
     r"2bw needs at least as many microbatches per batch as pipeline stages \(m=2 < d=4\): "
     r"--rampup-batch-size 2 2 24 starts at global batch 2 \(2 microbatches of 1 per replica\): "
     r"start the ramp at 4 or more"),
    ("--rampup-batch-size 4 2 24 --global-batch-size 12 --micro-batch-size 4",
     r"the global batch 6 of iteration 3 \(after 8 samples\) is not divisible by "
     r"--micro-batch-size x data-parallel size = 4 x 1: use ramp batches that are multiples of "
     r"4, or add --decrease-batch-size-if-needed"),
    ('--step-batch-size-schedule "0:4 100:8" --decrease-batch-size-if-needed',
     "exclude each other"),
    ('--step-batch-size-schedule "0:8 0.128K:4"', "the global batch falls from 8 to 4"),
    ('--step-batch-size-schedule "32:4 128:8"', "first threshold is 32 tokens = 2 samples"),
    ('--step-batch-size-schedule "0:4 8:8 0.128K:12"', "thresholds 0 and 8 tokens are both "
                                                         "sample 0"),
    ("--rampup-batch-size 2 2 24 --global-batch-size 12 --micro-batch-size 4 "
     "--decrease-batch-size-if-needed", "the first global batch 0 is smaller than"),
])
def test_a_bad_ramp_is_one_line_before_anything_runs(flags, message):
    with pytest.raises(ConfigError, match=message) as e:
        built(flags + " --train-iters 6", world=4 if "pipeline-model" in flags else 1)
    assert "\n" not in str(e.value)


def test_the_fix_a_refusal_suggests_is_accepted():
    cfg = built("--rampup-batch-size 4 2 24 --global-batch-size 12 --micro-batch-size 4 "
                "--decrease-batch-size-if-needed --train-iters 6").config
    assert [cfg.batch_plan.batch(t) for t in range(6)] == [4, 4, 4, 8, 8, 12]  # 6, 10: 4, 8
    ok = built("--rampup-batch-size 4 4 24 --global-batch-size 12 --micro-batch-size 1 "
               "--pipeline-model-parallel-size 4 --pipeline-schedule 2bw --train-iters 6 "
               "--num-layers 4", world=4)
    assert "train at global batch 4 (m=4) from iteration 1 -> 8 (m=8)" in ok.notes[-1]
    assert "2bw drains and refills the pipeline at each of the 2 changes" in ok.notes[-1]


def test_a_ramp_the_run_never_leaves_is_its_first_batch():
    b = built("--rampup-batch-size 16 16 5859375 --global-batch-size 1536 --train-iters 3")
    assert b.config.global_batch_size == 1536 and b.config.batch_plan.batch(2) == 16
    assert "the 3 iterations of this run train at global batch 16 (m=16) from iteration 1" \
        in b.notes[-1]
    long = built("--rampup-batch-size 16 16 5859375 --global-batch-size 1536 "
                 "--train-iters 500000").notes[-1]
    assert "16 (m=16) from iteration 1 -> 32 (m=32) from iteration 3856 -> " in long
    assert "-> ... 91 more ... -> 1520 (m=1520) from iteration 19763 -> 1536 (m=1536) " in long
    assert "drains" not in long and len(long) < 600  # flush drains at every batch anyway
    # Megatron checks only the batches it reaches: 1536 % 7 is never asked
    built("--rampup-batch-size 14 14 5859375 --global-batch-size 1540 --micro-batch-size 7 "
          "--train-iters 3")


def test_replicas_read_their_share_of_consumed_to_consumed_plus_b():
    from megatron_2bw.training.build import batches
    cfg = built("--rampup-batch-size 8 8 32 --global-batch-size 24 --micro-batch-size 2 "
                "--data-parallel-size 2 --train-iters 6", world=2).config

    class Index:  # sample i is i
        def __getitem__(self, i):
            return i

    class Take(type(batches(cfg, Index(), 2, 0))):
        def collate(self, samples):
            return samples
    plan = cfg.batch_plan
    for start in (0, 2, 3):
        streams = [Take(Index(), 2, plan, 2, r, start_batch=start) for r in range(2)]
        for t in range(start, 6):
            got = [i for s in streams for _ in range(plan.m(t)) for i in next(s)]
            c = plan.consumed(t)
            assert got == list(range(c, c + plan.batch(t))), (start, t)
    assert [plan.batch(t) for t in range(6)] == [8, 8, 16, 24, 24, 24]


def test_the_memory_check_and_the_planner_size_for_the_largest_batch():
    from megatron_2bw.planner.auto import search_for
    from megatron_2bw.planner.memory_check import stage_estimates
    from megatron_2bw.planner.profile import AnalyticProfile
    from megatron_2bw.planner.topology import Topology
    ramp = built("--rampup-batch-size 4 4 24 --global-batch-size 12 --micro-batch-size 2 "
                 "--pipeline-model-parallel-size 2 --pipeline-schedule gpipe --train-iters 8",
                 world=2).config
    final = built("--global-batch-size 12 --micro-batch-size 2 --pipeline-model-parallel-size 2 "
                  "--pipeline-schedule gpipe --train-iters 8", world=2).config
    assert stage_estimates(ramp, 2) == stage_estimates(final, 2)  # GPipe stashes all m = 6
    assert stage_estimates(ramp, 2) != stage_estimates(final.replace(
        batch={"global_batch_size": 4}), 2)
    # --auto-plan keeps only layouts whose smallest batch every schedule takes (2bw: m >= d)
    planned = built("--rampup-batch-size 8 8 32 --global-batch-size 32 --train-iters 8 "
                    "--pipeline-schedule 2bw", world=8).config
    topology = Topology(num_nodes=1, gpus_per_node=8)

    def layouts(cfg):
        return {e.layout for e in search_for(cfg, topology, AnalyticProfile(), top_k=200,
                                             ).ranked}
    smallest = planned.batch.rampup_batch_size[0]

    def suits(L):  # the ramp's first batch: whole microbatches, and the schedule's minimum m
        unit = L.micro_batch * L.data
        return smallest % unit == 0 and schedule_kind(L.schedule).accepts(L.pipeline,
                                                                           smallest // unit)
    ramped = layouts(planned)
    assert ramped and all(suits(L) for L in ramped) and any(L.pipeline > 1 for L in ramped)
    unramped = layouts(built("--global-batch-size 32 --train-iters 8", world=8).config)
    assert any(not suits(L) for L in unramped)  # e.g. 2bw d=8 b=2: m=16 at 32, 4 at 8


def test_decrease_batch_size_if_needed_with_one_global_batch_and_a_deepspeed_json(tmp_path):
    """Megatron's constant calculator rounds the one batch down too; a DeepSpeed JSON's
    train_batch_size is the ramp's final batch (Megatron-DeepSpeed's BLOOM scripts)."""
    b = built("--global-batch-size 10 --micro-batch-size 4 --decrease-batch-size-if-needed "
              "--train-iters 3")
    real = calculator.ConstantNumMicroBatchesCalculator(10, 4, 1, True, 1)
    assert (b.config.batch_plan.batch(2), b.config.batch_plan.m(2)) == \
        (real.get_current_running_global_batch_size(), real.get()) == (8, 2)
    assert b.config.batch_plan.consumed(3) == 24 and "runs rounded down" in b.notes[-1]
    with pytest.raises(ConfigError, match="is not divisible by --micro-batch-size"):
        built("--global-batch-size 10 --micro-batch-size 4 --train-iters 3")
    import json

    from megatron_2bw.config.ds_json import explicit_flags
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2}))
    argv = shlex.split(f"{TINY} --rampup-batch-size 4 4 24 --global-batch-size 12 --deepspeed "
                       f"--deepspeed_config {ds} --train-iters 7")
    cfg = build_config(build_parser("gpt").parse_args(argv), "gpt", 1,
                       explicit_flags(argv)).config
    assert [cfg.batch_plan.batch(t) for t in range(7)] == [4, 4, 4, 8, 8, 12, 12]
    argv = shlex.split(f'{TINY} --step-batch-size-schedule "0:4 0.192K:8 0.448K:16" '
                       f"--deepspeed --deepspeed_config {ds} --train-iters 7")
    with pytest.raises(ConfigError, match=r"sets the global batch to its largest step \(16\), "
                                          "not 12: drop the other global batch"):
        build_config(build_parser("gpt").parse_args(argv), "gpt", 1, explicit_flags(argv))
