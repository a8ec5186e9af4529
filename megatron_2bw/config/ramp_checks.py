"""The refusals and the log line of a batch-size ramp (ramps.py), on a resolved Config.

`ramp_error(cfg)` is `Config.validate`'s rule (checks.py), before any process group, one line,
Megatron's own refusals where it has them:
- a step schedule whose largest batch is not the global batch, whose first threshold is not 0
  samples, with two thresholds on the same sample, or a batch that falls (Megatron's training
  loop asserts that m never decreases), or with --decrease-batch-size-if-needed (Megatron:
  "Cannot specify both");
- a first batch that rounds down to no microbatch per replica;
- without --decrease-batch-size-if-needed, a batch the run reaches that is not a multiple of
  micro batch x data-parallel size (Megatron asserts it when it gets there);
- a schedule kind's minimum m at the smallest batch (2BW: m >= d at every step of the ramp).
`ramp_note(cfg)` is the line the log prints before training.
"""
from __future__ import annotations

from megatron_2bw.config.ramps import schedule_samples
from megatron_2bw.schedule.kinds import schedule_kind


def ramp_flag(batch) -> str:
    """The ramp as typed (for messages)."""
    if batch.rampup_batch_size is not None:
        return "--rampup-batch-size " + " ".join(map(str, batch.rampup_batch_size))
    if batch.step_batch_size_schedule is not None:
        return ('--step-batch-size-schedule "'
                + " ".join(f"{t}:{b}" for t, b in batch.step_batch_size_schedule) + '"')
    return f"--global-batch-size {batch.global_batch_size} --decrease-batch-size-if-needed"


def _schedule_error(batch, seq_length: int) -> str | None:
    flag = ramp_flag(batch)
    if batch.decrease_batch_size_if_needed:
        return (f"{flag} and --decrease-batch-size-if-needed exclude each other (Megatron's "
                "rule): drop --decrease-batch-size-if-needed and give batches that are "
                "multiples of micro batch x data-parallel size")
    table, tokens = schedule_samples(batch, seq_length), batch.step_batch_size_schedule
    top = max(b for _, b in table)
    if batch.global_batch_size != top:  # e.g. a DeepSpeed JSON's train_batch_size
        return (f"{flag} sets the global batch to its largest step ({top}), not "
                f"{batch.global_batch_size}: drop the other global batch (--global-batch-size, "
                "train_batch_size in the DeepSpeed config)")
    if table[0][0] != 0:
        return (f"{flag}: its first threshold is {tokens[0][0]} tokens = {table[0][0]} samples "
                f"of --seq-length {seq_length}: start the schedule at 0")
    for (a, b), (x, y), (ta, _), (tx, _) in zip(table, table[1:], tokens, tokens[1:]):
        if x == a:
            return (f"{flag}: thresholds {ta} and {tx} tokens are both sample {a} at "
                    f"--seq-length {seq_length}: give thresholds at least {seq_length} tokens "
                    "apart")
        if y < b:
            return (f"{flag}: the global batch falls from {b} to {y} at {tx} tokens (Megatron's "
                    "training loop refuses a falling number of microbatches): give batches "
                    "that never fall")
    return None


def ramp_error(cfg) -> str | None:
    """A one-line refusal of the ramp of the resolved config `cfg` (None: none, or no ramp)."""
    batch, seq = cfg.batch, cfg.model.seq_length
    if not (batch.rampup_batch_size or batch.step_batch_size_schedule
            or batch.decrease_batch_size_if_needed):
        return None
    flag = ramp_flag(batch)
    if batch.step_batch_size_schedule is not None:
        error = _schedule_error(batch, seq)
        if error:
            return error
    b, w = batch.micro_batch_size, cfg.data_parallel_size
    unit = b * w
    first = cfg.global_batch_at(0)
    if first < unit:
        return (f"{flag}: the first global batch {first} is smaller than --micro-batch-size x "
                f"data-parallel size = {b} x {w}: it holds no microbatch per replica; start at "
                f"{unit} or more, or lower --micro-batch-size")
    reached = cfg.batch_plan.reached(cfg.train.train_iters)
    if not batch.decrease_batch_size_if_needed:
        for s in reached:
            if s.batch % unit:
                fix = (", or add --decrease-batch-size-if-needed (Megatron's: each batch runs "
                       "rounded down to a multiple)" if batch.step_batch_size_schedule is None
                       else "")
                return (f"{flag}: the global batch {s.batch} of iteration {s.first + 1} (after "
                        f"{s.consumed} samples) is not divisible by --micro-batch-size x "
                        f"data-parallel size = {b} x {w}: use ramp batches that are multiples "
                        f"of {unit}{fix}")
    kind, d = schedule_kind(cfg.schedule), cfg.parallel.pipeline
    low = kind.min_microbatches(d)
    return kind.microbatch_error(
        d, reached[0].m, f"{flag} starts at global batch {reached[0].batch} ({reached[0].m} "
        f"microbatch{'es' * (reached[0].m != 1)} of {b} per replica): start the ramp at "
        f"{low * unit} or more, or lower --micro-batch-size")


def ramp_note(cfg) -> str | None:
    """The log line of a ramp: how the batch grows and where this run's changes are."""
    batch = cfg.batch
    plan = cfg.batch_plan
    if not (batch.rampup_batch_size or batch.step_batch_size_schedule
            or batch.decrease_batch_size_if_needed):
        return None
    flag, iters = ramp_flag(batch), cfg.train.train_iters
    reached = plan.reached(iters)
    if batch.rampup_batch_size is not None:
        start, inc, samples = batch.rampup_batch_size
        how = (f"the global batch grows from {start} by {inc} to {batch.global_batch_size} "
               f"over {samples} samples")
    elif batch.step_batch_size_schedule is not None:
        how = "the global batch steps " + ", ".join(
            f"{b} from sample {t}" for t, b in schedule_samples(batch, cfg.model.seq_length))
    else:
        how = (f"the global batch {batch.global_batch_size} runs rounded down to a multiple "
               f"of micro batch x data-parallel size {plan.unit}")
    if batch.decrease_batch_size_if_needed and batch.rampup_batch_size is not None:
        how += (f" (each rounded down to a multiple of micro batch x data-parallel size "
                f"{plan.unit})")
    steps = [f"{s.batch} (m={s.m}) from iteration {s.first + 1}" for s in reached]
    if len(steps) > 6:  # a GPT-3 ramp has 96
        steps = steps[:3] + [f"... {len(steps) - 5} more ..."] + steps[-2:]
    line = (f"megatron-2bw: {flag}: {how} (Megatron's num-microbatches arithmetic): the "
            f"{iters} iterations of this run train at global batch " + " -> ".join(steps))
    if len(reached) > 1 and not schedule_kind(cfg.schedule).flushes:
        line += (f"; {cfg.schedule} drains and refills the pipeline at each of the "
                 f"{len(reached) - 1} changes")
    return line
