"""The communication layer (parallel/comm.py, devices.py, distributed.py): the backend's device, the
one-line device error, the set-up order clusters need, and the groups it creates (issue 13)."""
import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron_2bw.config import ConfigError
from megatron_2bw.parallel import comm as comm_mod
from megatron_2bw.parallel import devices
from megatron_2bw.parallel import distributed as D
from megatron_2bw.parallel.comm import Comm, CommDeviceError
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.training.spawn import spawn


@pytest.fixture
def four_gpus(monkeypatch):
    """CUDA as a cluster node shows it (nothing runs on it: these tests only resolve devices)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append(("set_device", dev)))
    return calls


def test_a_tensor_off_the_backends_device_is_a_one_line_error():
    comm = Comm("cuda:1", "nccl")     # declared; nothing touches a GPU before the check
    t = torch.zeros(2)
    for call in (lambda: comm.all_reduce(t), lambda: comm.broadcast(t, 0),
                 lambda: comm.all_gather([torch.zeros(2)], t), lambda: comm.send(t, 1),
                 lambda: comm.recv(t, 1), lambda: comm.batch_isend_irecv([(t, 1)], [])):
        with pytest.raises(CommDeviceError, match=r"^\w+: tensor on cpu, but the nccl backend "
                                                  r"of rank 0 communicates on cuda:1: create it "
                                                  r"with device=comm\.device") as e:
            call()
        assert "\n" not in str(e.value)


def test_a_component_on_another_device_is_named(monkeypatch):
    monkeypatch.setattr(comm_mod, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    with pytest.raises(CommDeviceError, match="the pipeline engine runs on cpu, but the nccl "
                                              "backend of rank 3 communicates on cuda:1"):
        Comm("cuda:1", "nccl").expect_device("cpu", "the pipeline engine")
    Comm("cpu", "gloo").expect_device(torch.device("cpu"), "the pipeline engine")


def test_nccl_communicates_on_the_local_ranks_gpu(four_gpus):
    assert devices.backend_device("nccl", 2) == torch.device("cuda", 2)
    # --gpus-per-task style wrap
    assert devices.backend_device("nccl", 6) == torch.device("cuda", 2)
    assert devices.backend_device("gloo", 3) == torch.device("cpu")
    assert four_gpus == [], "resolving a device sets nothing"


def test_nccl_without_gpus_is_a_clear_error_before_any_process_group(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = ("the nccl backend needs CUDA GPUs and this process sees none: use "
           "--distributed-backend gloo")
    with pytest.raises(ConfigError, match=msg):
        devices.backend_device("nccl", 0)
    from megatron_2bw.pretrain import main
    with pytest.raises(SystemExit) as e:
        main("gpt", ["--mock-data", "--num-layers", "2", "--hidden-size", "32",
                     "--num-attention-heads", "4", "--seq-length", "16", "--train-iters", "1",
                     "--distributed-backend", "nccl"])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == f"error: {msg}" + \
        " or check CUDA_VISIBLE_DEVICES"
    assert not dist.is_initialized()


def test_comm_of_a_process_group_uses_the_launchers_local_rank(four_gpus, monkeypatch):
    """Not the current device: before the engine sets it, every local rank's current device is
    cuda:0 (the PipelineModule 'profile' bug of issue 13)."""
    monkeypatch.setattr(comm_mod, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("WORLD_SIZE", "8")
    comm = Comm()
    assert (comm.backend, comm.device) == ("nccl", torch.device("cuda", 3))


def test_set_up_order_device_then_group_bound_to_it(four_gpus, monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)  # restored afterwards
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda **kw: four_gpus.append(("init_process_group", kw)))
    comm = D.start_process_group(5, 8, local_rank=5, backend="nccl", init_method="tcp://h:1")
    assert [c[0] for c in four_gpus] == ["set_device", "init_process_group"]
    assert four_gpus[0][1] == torch.device("cuda", 1)
    init = four_gpus[1][1]
    assert init["device_id"] == torch.device("cuda", 1) and init["backend"] == "nccl"
    assert (init["rank"], init["world_size"]) == (5, 8)
    assert (comm.device, comm.backend) == (torch.device("cuda", 1), "nccl")
    assert comm.timeout_minutes == 10.0 and init["timeout"].total_seconds() == 600
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3", "the watchdog tears down"
    four_gpus.clear()
    comm = D.start_process_group(0, 2, local_rank=1, backend="gloo", init_method="tcp://h:1")
    assert [c[0] for c in four_gpus] == ["init_process_group"]
    assert "device_id" not in four_gpus[0][1] and comm.device == torch.device("cpu")


class _RecordingComm(Comm):
    def __init__(self):
        super().__init__("cpu", "gloo")
        self.created = []

    def new_group(self, ranks, desc=None):
        self.created.append(list(ranks))
        return f"group{len(self.created) - 1}"


def test_nccl_error_handling_leaves_the_users_choice_alone():
    assert D.nccl_error_handling({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    for theirs in ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, {"NCCL_ASYNC_ERROR_HANDLING": "0"}):
        env = dict(theirs)
        assert D.nccl_error_handling(env) == {} and env == theirs


@pytest.mark.parametrize("t,d,w,rank,prev,nxt", [(1, 2, 2, 1, None, 3), (2, 3, 1, 3, 1, 5),
                                                 (1, 1, 4, 2, None, None)])
def test_grid_groups_are_created_through_its_comm_with_a_group_per_stage_pair(t, d, w, rank,
                                                                               prev, nxt):
    comm = _RecordingComm()
    grid = ProcessGrid(t, d, w, rank=rank).init_groups(comm)
    assert grid.comm is comm
    everything = [g for groups in grid.all_group_ranks().values() for g in groups if len(g) > 1]
    planned = [g for _, groups in grid.group_splits() for g in groups]
    assert comm.created == planned, "gloo cannot split: every rank creates each group, in order"
    assert sorted(map(sorted, planned)) == sorted(map(sorted, everything)), "each group once"
    assert (grid.prev_rank, grid.next_rank) == (prev, nxt)
    assert sorted(grid.pairs) == sorted(p for p in (prev, nxt) if p is not None)
    for peer, group in grid.pairs.items():
        assert sorted(comm.created[int(group[5:])]) == sorted([rank, peer])
    with pytest.raises(ValueError, match="is not a neighbouring stage of rank"):
        grid.pair_group(rank)


def _profile_worker(rank, world_size, out):
    from megatron_2bw.deepspeed.pipe.module import PipelineModule, _max_over_ranks
    from megatron_2bw.deepspeed.pipe import LayerSpec
    torch.set_default_device("meta")   # the costs' tensor must name the backend's device
    agreed = _max_over_ranks([1.0, 5.0] if rank == 0 else [3.0, 2.0])
    torch.set_default_device("cpu")
    layers = [LayerSpec(torch.nn.Linear, 8, 8) for _ in range(6)]
    net = PipelineModule(layers, num_stages=2, partition_method="profile",
                         profile_input=torch.randn(4, 8))
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"agreed": agreed, "parts": net.parts}, f)


def test_profile_partition_agrees_across_ranks_through_the_comm_layer(tmp_path):
    spawn(_profile_worker, 2, args=(str(tmp_path / "o"),), timeout_minutes=1)
    outs = [json.load(open(tmp_path / f"o.{r}")) for r in range(2)]
    assert outs[0]["agreed"] == outs[1]["agreed"] == [3.0, 5.0]
    assert outs[0]["parts"] == outs[1]["parts"], "measured costs differ; the partition must not"
