"""Table generators: one stage's ordered action list for a segment of batches, pure functions.

Each generator takes (s, d, m, T, t0, slot) and returns stage s's actions for batches
t0 .. t0+T-1 (microbatch k belongs to batch k // m); `slot(k)` is the weight-version slot of
microbatch k, which only the schedule kind knows (`kinds.py`). Sizes and m >= d-style
requirements are checked by the kind before a generator runs.

    gpipe    all forwards of a batch, then all backwards (reverse order), then R N S.
    gpipe in flushes  the same over chunks of at most k microbatches, R N S once per batch
             (`gpipe_in_flushes`: --gpipe-microbatches-per-flush k).
    1f1b     Megatron's 1F1B (warm-up, steady one-forward-one-backward, cool-down).
    flush    1F1B with a flush at every batch boundary, then R N S.
    2bw      1F1B run continuously over the whole segment, with R/N/S inserted (see `twobw`).
    2bw, one gradient buffer  the same, S(t) before the first backward of batch t+1
             (`twobw_one_buffer`).
    forward  ra F sa for every microbatch (eval).
"""
from __future__ import annotations

from megatron_2bw.schedule.actions import BACKWARD, B, F, N, R, RA, RG, S, SA, SG


def one_f_one_b(s: int, d: int, mbs: list, slot) -> list:
    """Megatron's 1F1B over `mbs` on stage s (warm-up, steady 1F1B, cool-down)."""
    first, last = s == 0, s == d - 1
    n = len(mbs)
    out = []
    warm = min(d - 1 - s, n)
    for k in mbs[:warm]:
        if not first:
            out.append(RA(k))
        out.append(F(k, slot(k)))
        if not last:
            out.append(SA(k))
    rem = n - warm
    if rem and not first:
        out.append(RA(mbs[warm]))
    for i in range(rem):
        f, b = mbs[warm + i], mbs[i]
        out.append(F(f, slot(f)))
        if not last:
            out += [SA(f), RG(b)]
        out.append(B(b, slot(b)))
        if not first:
            out.append(SG(b))
            if i != rem - 1:
                out.append(RA(mbs[warm + i + 1]))
    for b in mbs[rem:]:
        if not last:
            out.append(RG(b))
        out.append(B(b, slot(b)))
        if not first:
            out.append(SG(b))
    return out


def _gpipe_batch(s: int, d: int, mbs: list, slot) -> list:
    out = []
    for k in mbs:
        if s > 0:
            out.append(RA(k))
        out.append(F(k, slot(k)))
        if s < d - 1:
            out.append(SA(k))
    for k in reversed(mbs):
        if s < d - 1:
            out.append(RG(k))
        out.append(B(k, slot(k)))
        if s > 0:
            out.append(SG(k))
    return out


def _batches(m: int, T: int, t0: int):
    for t in range(t0, t0 + T):
        yield t, list(range(t * m, (t + 1) * m))


def gpipe(s: int, d: int, m: int, T: int, t0: int, slot) -> list:
    return gpipe_in_flushes(s, d, m, T, t0, slot, m)  # one flush of all m


def gpipe_in_flushes(s: int, d: int, m: int, T: int, t0: int, slot, per_flush: int) -> list:
    """GPipe admitting at most `per_flush` microbatches at a time: each batch's m microbatches
    run as ceil(m / per_flush) GPipe flushes in order (all forwards of a flush, then its
    backwards in reverse), their gradients accumulating into the batch's one buffer, then R N S
    once per batch. What the paper's GPipe does at a global batch whose m stashes do not fit
    (Narayanan et al., ICML 2021, Sec. 5.3: "the maximum number of microbatches it can admit is
    small, leading to a larger pipeline bubble"). For d = 2, m = 4, per_flush = 2, stage 0:

        F0 F1 B1 B0 F2 F3 B3 B2 R N S
    """
    out = []
    for t, mbs in _batches(m, T, t0):
        for i in range(0, m, per_flush):
            out += _gpipe_batch(s, d, mbs[i:i + per_flush], slot)
        out += [R(t), N(t), S(t)]
    return out


def flush(s: int, d: int, m: int, T: int, t0: int, slot) -> list:
    out = []
    for t, mbs in _batches(m, T, t0):
        out += one_f_one_b(s, d, mbs, slot) + [R(t), N(t), S(t)]
    return out


def twobw(s: int, d: int, m: int, T: int, t0: int, slot) -> list:
    """1F1B over the whole segment, then R/N/S inserted:

    R(t) right after B of the batch's last microbatch; N(t) right after the first compute action
    after R(t); S(t) right after B((t+1)m + s), s + 1 backwards after R(t): time for every stage
    to post N(t) (stage 0 posts it last, about one backward per stage after stage s) so that S(t)
    does not wait for the norm's all-reduce, and as early as that allows, so that what S(t)
    leaves for later (a 2BW compensation's prediction, pipeline/compensation.py) can be done in
    the waits before F of batch t+2, the first forward that needs W(t+1). With m = d that B is
    the last one before F of batch t+2 (m >= d: never later). S(last) at the very end. Where one
    B carries both S(t-1) and R(t) (last stage, m = d), S(t-1) goes first so that R(t) opens
    window t.
    """
    base = one_f_one_b(s, d, list(range(t0 * m, (t0 + T) * m)), slot)
    last = t0 + T - 1
    out, pending = [], []
    for a in base:
        out.append(a)
        if not a.is_compute:
            continue
        out += [N(t) for t in pending]
        pending = []
        if a.kind == BACKWARD:
            if (a.mb - s) % m == 0 and t0 <= (a.mb - s) // m - 1 < last:
                out.append(S((a.mb - s) // m - 1))
            if (a.mb + 1) % m == 0:
                out.append(R((a.mb + 1) // m - 1))
                pending.append((a.mb + 1) // m - 1)
    out += [N(t) for t in pending]
    out.append(S(last))
    return out


def _with_steps(base: list, m: int, t0: int, T: int, before=(), after=()) -> list:
    """R/N/S into the 1F1B list `base`: R(t) right after B of batch t's last microbatch, N(t)
    right after the next compute action, S(t) right before base[i] for each (i, t) of `before`
    or right after the compute action base[i] for each (i, t) of `after` (a pending N first);
    S(last) at the very end."""
    before, after = dict(before), dict(after)
    out, pending = [], []

    def norms():
        out.extend(N(t) for t in pending)
        pending.clear()
    for i, a in enumerate(base):
        if i in before:
            norms()
            out.append(S(before[i]))
        out.append(a)
        if not a.is_compute:
            continue
        norms()
        if a.kind == BACKWARD and (a.mb + 1) % m == 0:
            out.append(R((a.mb + 1) // m - 1))
            pending.append((a.mb + 1) // m - 1)
        if i in after:
            norms()
            out.append(S(after[i]))
    norms()
    out.append(S(t0 + T - 1))
    return out


def _first_backwards(base: list, m: int, t0: int, T: int):
    """(index in `base`, t) of B((t+1)m), the first backward of batch t+1, for t0 <= t < last."""
    return [(i, a.mb // m - 1) for i, a in enumerate(base)
            if a.kind == BACKWARD and a.mb % m == 0 and t0 <= a.mb // m - 1 < t0 + T - 1]


def twobw_one_buffer(s: int, d: int, m: int, T: int, t0: int, slot) -> list:
    """2BW with one gradient buffer per stage: 1F1B over the whole segment as in `twobw`, R(t)
    right after B of the batch's last microbatch, but S(t) must consume and zero the buffer
    before B((t+1)m), the stage's first backward of batch t+1, accumulates into it: S(t) goes
    right after the compute action before that B (N(t) right before S(t) when that action is
    the one after R(t)), ahead of the communication group in between, so that the sends and
    receives of the microbatch whose forward it follows fall in window t+1 on both stages of a
    channel. The stage waits there for N(t)'s all-reduce (what the one buffer costs).
    S(last) at the very end."""
    base = one_f_one_b(s, d, list(range(t0 * m, (t0 + T) * m)), slot)
    computes = [i for i, a in enumerate(base) if a.is_compute]
    previous = {i: computes[j - 1] for j, i in enumerate(computes) if j}
    return _with_steps(base, m, t0, T, after=[(previous[i], t) for i, t in
                                              _first_backwards(base, m, t0, T) if i in previous])


def twobw_first_stage_one_buffer(s: int, d: int, m: int, T: int, t0: int, slot) -> list:
    """2BW with one gradient buffer on stage 0 and two on the others: stages > 0 run `twobw`;
    stage 0 runs 1F1B with R(t) and N(t) placed as there, and S(t) right before B((t+1)m), its
    first backward of batch t+1, after the communication group that receives that backward's
    gradient (so that receive stays in window t, as its send on stage 1 does). Stage 0 posts
    N(t) last of all stages, so its S(t) waits only for that all-reduce's own latency, and what
    it steps is the stage's only gradient buffer: the stage that keeps the most microbatches in
    flight saves one buffer at about no time. S(last) at the very end."""
    if s > 0:
        return twobw(s, d, m, T, t0, slot)
    base = one_f_one_b(s, d, list(range(t0 * m, (t0 + T) * m)), slot)
    return _with_steps(base, m, t0, T, before=_first_backwards(base, m, t0, T))


def forward(s: int, d: int, m: int, T: int, t0: int, slot) -> list:
    """Eval: ra(k) F(k) sa(k) for every microbatch of the segment (no B/R/N/S)."""
    out = []
    for k in range(t0 * m, (t0 + T) * m):
        if s > 0:
            out.append(RA(k))
        out.append(F(k, slot(k)))
        if s < d - 1:
            out.append(SA(k))
    return out


__all__ = ["one_f_one_b", "gpipe", "gpipe_in_flushes", "flush", "twobw", "twobw_one_buffer",
           "twobw_first_stage_one_buffer", "forward"]
