"""Control flags ride in the per-batch reductions (pipeline/flags.py), and point-to-point uses the
pipeline's pair groups (parallel/p2p.py) (issue 13)."""
import json

import pytest
import torch
import torch.distributed as dist

from megatron_2bw.config.build import build_config
from megatron_2bw.parallel.comm import Comm
from megatron_2bw.pipeline.flags import FLAGS, ControlFlags
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.spawn import spawn

BASE = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3").split()


def test_flags_are_read_one_batch_behind():
    flags = ControlFlags("cpu")
    tail = torch.zeros(len(FLAGS))
    assert FLAGS == ("preempt", "exit_duration", "save_busy")
    none = dict.fromkeys(FLAGS, False)
    flags.raise_flag("exit_duration")
    flags.write(tail)
    assert tail.tolist() == [0.0, 1.0, 0.0]
    assert flags.agreed() == none                                         # nothing carried yet
    # carried: [loss, *flag sums, *one finiteness bit per stage] (one stage here)
    flags.carried(0, torch.tensor([5.0, 0.0, 0.5, 1.0, 0.0]))
    assert flags.agreed() == none                                         # batch -1: none
    flags.carried(1, torch.tensor([4.0, 2.0, 0.0, 0.0, 0.0]))
    assert flags.agreed() == dict(none, exit_duration=True, save_busy=True)  # batch 0's sums
    flags.carried(2, torch.tensor([3.0, 0.0, 0.0, 0.0, 0.0]))
    assert flags.agreed() == dict(none, preempt=True)                     # batch 1's sums
    flags.raise_flag("exit_duration", False)
    tail.zero_()
    flags.write(tail)
    assert tail.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="unknown control flag 'stop': use one of"):
        flags.raise_flag("stop")


def test_numerics_name_the_nonfinite_stages_one_batch_behind_or_newest():
    flags = ControlFlags("cpu", num_stages=3)
    assert flags.numerics() is None and flags.numerics(newest=True) is None
    flags.carried(0, torch.tensor([2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert flags.numerics() is None and flags.numerics(newest=True) == (0, 2.5, [])
    flags.carried(1, torch.tensor([float("nan"), 0.0, 0.0, 1.0, 1.0, 0.0, 2.0]))
    assert flags.numerics() == (0, 2.5, [])
    batch, loss, stages = flags.numerics(newest=True)
    assert batch == 1 and loss != loss and stages == [0, 2]
    flags.carried(2, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
    assert flags.numerics()[2] == [0, 2] and flags.numerics(newest=True)[2] == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flags_on_a_gpu_go_through_pinned_memory_without_a_host_sync():
    flags = ControlFlags("cuda")
    for batch, sums in enumerate([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 3.0, 0.0]]):
        flags.carried(batch, torch.tensor([1.0, *sums, float(batch == 2)], device="cuda"))
        expected = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]][batch]
        assert flags.agreed() == dict(zip(FLAGS, [v > 0 for v in expected]))
    assert flags.numerics() == (1, 1.0, []) and flags.numerics(newest=True) == (2, 1.0, [0])
    assert all(host.is_pinned() for host in flags._host)


class _P2PRecorder(Comm):
    """Records the members of every group a point-to-point call uses (a test hook object)."""

    def __init__(self):
        super().__init__()
        self.p2p_groups = set()

    def _note(self, group):
        self.p2p_groups.add(None if group is None else tuple(dist.get_process_group_ranks(group)))

    def batch_isend_irecv(self, sends, recvs, group=None):
        self._note(group)
        return super().batch_isend_irecv(sends, recvs, group)

    def send(self, tensor, peer, group=None):
        self._note(group)
        super().send(tensor, peer, group)

    def recv(self, tensor, peer, group=None):
        self._note(group)
        super().recv(tensor, peer, group)


def _worker(rank, world_size, t, d, raiser, out):
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine, mock_batches
    argv = BASE + ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size",
                   str(d)]
    cfg = build_config(build_parser("gpt").parse_args(argv), "gpt", world_size).config
    comm = _P2PRecorder()
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups(comm)
    result = {}
    for who in (raiser, None):
        engine = build_engine(cfg, grid, "cpu")
        data = mock_batches(cfg, grid.data, grid.dp_rank)
        engine.start(5)
        seen = []
        for it in range(1, 6):
            engine.train_batch(data)
            if rank == who and it == 2:
                engine.stepper.flags.raise_flag("preempt")
            seen.append(engine.stepper.flags.agreed()["preempt"])
        result[str(who)] = {"seen": seen,
                            "weights": float(engine.weights.fp32_weights(0).double().sum())}
    result["p2p_groups"] = sorted(sorted(g) if g else [] for g in comm.p2p_groups)
    result["neighbours"] = sorted(p for p in (grid.prev_rank, grid.next_rank) if p is not None)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


@pytest.mark.parametrize("t,d,w,raiser", [(1, 2, 2, 3), (2, 2, 1, 3)])
def test_a_flag_on_one_rank_is_agreed_everywhere_at_the_same_boundary(tmp_path, t, d, w, raiser):
    """Rank 3 (the last stage of the second replica / its second tensor rank) raises after
    iteration 2: batch 3 carries it, every rank acts after iteration 4. Flags never touch the
    weights. Every p2p call uses the two-rank group of this rank and its neighbour."""
    world = t * d * w
    spawn(_worker, world, args=(t, d, raiser, str(tmp_path / "o")), timeout_minutes=1)
    outs = [json.load(open(tmp_path / f"o.{r}")) for r in range(world)]
    for o in outs:
        assert o[str(raiser)]["seen"] == [False, False, False, True, True]
        assert o["None"]["seen"] == [False] * 5
        assert o[str(raiser)]["weights"] == o["None"]["weights"]
    for rank, o in enumerate(outs):
        assert o["p2p_groups"], "stages exchanged activations"
        assert o["p2p_groups"] == sorted(sorted([rank, p]) for p in o["neighbours"]), rank
