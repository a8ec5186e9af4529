"""Every group gets --distributed-timeout-minutes (issue 29, point 1): with rank 0 frozen (asleep
in the test's function), rank 1's wait on a stage-pair receive, a data-parallel all-reduce and a
world barrier each ends within the timeout as one line naming rank 0 and what it waited on.

Before, only the world group had the timeout: the pair and data-parallel groups had gloo's
default of 30 minutes (a receive on a pair group still waited after 35 s with a 0.1 min timeout).
"""
import time

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from megatron_2bw.parallel.comm import Comm, PeerError
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.parallel.p2p import P2P
from megatron_2bw.pipeline.batch_step import _wait
from megatron_2bw.training.spawn import spawn

TIMEOUT_MIN = 0.05  # 3 s


def _frozen_peer(rank, world_size, case):
    comm = Comm()  # states no timeout: inherits the one spawn started the world group with
    assert comm.timeout_minutes == TIMEOUT_MIN
    shape = (1, 2, 1) if case == "pair" else (1, 1, 2)
    grid = ProcessGrid(*shape, rank=rank).init_groups(comm)
    comm.barrier()  # both ranks are up; now rank 0 freezes
    if rank == 0:
        time.sleep(3600)  # frozen: never answers; spawn ends it once rank 1 has failed
    started = time.monotonic()
    try:
        if case == "pair":  # rank 1 (stage 1) waits for the activation from stage 0
            p2p = P2P(grid, comm.device)
            p2p.post_recv("a", (torch.empty(4),), grid.prev_rank)
            p2p.wait_recv("a")
        elif case == "data":
            work = comm.all_reduce(torch.ones(4), grid.group("dp"), async_op=True)
            _wait([work], "data-parallel gradient all-reduce", grid=grid, kind="dp")
        else:
            comm.barrier()
    except PeerError as e:
        waited = time.monotonic() - started
        assert waited < 60 * TIMEOUT_MIN + 30, waited
        raise PeerError(f"{e} [waited {waited:.0f} s]") from None
    raise AssertionError("rank 1's wait returned although rank 0 never answered")


@pytest.mark.parametrize("case,line", [
    ("pair", "timed out after 3 s waiting for rank 0 (stage 0/2, data-parallel replica 0, "
             "tensor rank 0) on the activation receive (point-to-point on the stage pair): it "
             "may be frozen or dead; raise --distributed-timeout-minutes if it is only slow"),
    ("data", "timed out after 3 s waiting for rank 0 (stage 0/1, data-parallel replica 0, "
             "tensor rank 0) on the data-parallel gradient all-reduce: it may be frozen"),
    ("world", "timed out after 3 s waiting for rank 0 (stage 0/1, data-parallel replica 0, "
              "tensor rank 0) on the barrier (the world group): it may be frozen or dead"),
])
def test_a_frozen_rank_ends_the_wait_within_the_timeout_naming_it(case, line):
    started = time.monotonic()
    with pytest.raises(ProcessRaisedException) as raised:
        spawn(_frozen_peer, 2, args=(case,), timeout_minutes=TIMEOUT_MIN)
    assert time.monotonic() - started < 60 * TIMEOUT_MIN + 60
    message = str(raised.value)
    assert f"PeerError: {line}" in message, message[-2000:]
