"""Activation shapes that change between batches (issue 33 point 1): (2,8,16), (2,32,16), (2,8,16)
and back to (2,32,16) on 2 and 4 gloo stages, flush and 2bw, through the plain engine and through
the DeepSpeed adapter (PipelineModule(dynamic_shape=True)), equal per batch to the single-process
references (flush: plain training; 2bw: the delayed update) to 1e-5 in fp32. The receiving stage
learns a new shape from its sender (parallel/p2p.py "Shapes"): an unchanged shape costs no extra
message (the p2p operations are counted), a change costs one. With dynamic_shape the shape may
change at any microbatch; without it a change within a batch is one line on every rank (the
sender's names the cause; the others' name the lost rank), not a transport abort."""
import os
import tempfile

import pytest
import torch
from torch import nn

from megatron_2bw.models.stage import LayerSpec
from megatron_2bw.testing.reference import reference_train
from megatron_2bw.testing.verify import parse
from megatron_2bw.training.spawn import spawn

HIDDEN, MICRO, M = 16, 2, 4
CHANGING = [[8] * M, [32] * M, [8] * M, [32] * M]     # sequence length per batch, microbatch
CONSTANT = [[8] * M] * 4
WITHIN = [[8, 32, 32, 8], [16] * M, [8, 8, 32, 32], [32] * M]  # changes inside batches
LAYERS = 4


def _layer():
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())


def _loss(out, labels):
    return ((out - labels) ** 2).mean()


def _specs():
    return [LayerSpec(_layer, name="block") for _ in range(LAYERS)]


def _batches(seqs):
    def make(_dp_rank=0):
        for t, row in enumerate(seqs):
            for k, seq in enumerate(row):
                g = torch.Generator().manual_seed(100 * t + k)
                yield (torch.randn(MICRO, seq, HIDDEN, generator=g),
                       torch.randn(MICRO, seq, HIDDEN, generator=g))
    return make


def _cfg(schedule, d):
    cfg, _ = parse(["--schedule", schedule, "--pipeline-model-parallel-size", str(d),
                    "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
                    "--num-attention-heads", "4", "--seq-length", "8",
                    "--micro-batch-size", str(MICRO), "--global-batch-size", str(MICRO * M),
                    "--lr", "1e-2", "--train-iters", "4", "--timeout-minutes", "1"])
    return cfg


class _Counting:
    """The grid's Comm, counting the point-to-point tensors this rank sends and receives."""

    def __init__(self, comm):
        self._comm, self.sent, self.received = comm, 0, 0

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def send(self, tensor, peer, group=None):
        self.sent += 1
        return self._comm.send(tensor, peer, group)

    def recv(self, tensor, peer, group=None):
        self.received += 1
        return self._comm.recv(tensor, peer, group)

    def batch_isend_irecv(self, sends, recvs, group=None):
        self.sent, self.received = self.sent + len(sends), self.received + len(recvs)
        return self._comm.batch_isend_irecv(sends, recvs, group)


def _engine_run(d, schedule, seqs, dynamic):
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.pipeline.engine import PipelineEngine
    cfg = _cfg(schedule, d)
    grid = ProcessGrid.from_config(cfg, torch.distributed.get_rank(), d).init_groups()
    engine = PipelineEngine(cfg, grid, _specs(), _loss, [LAYERS * s // d for s in range(d + 1)],
                            "cpu", dynamic_shape=dynamic)
    engine.p2p.comm = counter = _Counting(engine.p2p.comm)
    engine.start(len(seqs))
    data = _batches(seqs)()
    losses = [float(engine.train_batch(data)) for _ in seqs]
    return {"losses": losses, "params": engine.fp32_state(), "stage": grid.stage,
            "ops": (counter.sent, counter.received)}


def _deepspeed_run(d, schedule, seqs):
    import megatron_2bw as deepspeed
    torch.manual_seed(0)
    net = deepspeed.pipe.PipelineModule(
        layers=[_layer() for _ in range(LAYERS)], num_stages=d, loss_fn=_loss,
        partition_method="uniform", dynamic_shape=True)
    config = {"train_batch_size": MICRO * M, "train_micro_batch_size_per_gpu": MICRO,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "pipeline": {"schedule": schedule}}
    eng, _, _, _ = deepspeed.initialize(model=net, config=config)
    data = _batches(seqs + seqs[-1:])()  # 2bw reads the next batch's first microbatches ahead
    return [float(eng.train_batch(data)) for _ in seqs]


def _worker(rank, world, outdir):
    out = {}
    for schedule in ("flush", "2bw"):
        out[("engine", schedule)] = _engine_run(world, schedule, CHANGING, False)
        out[("deepspeed", schedule)] = _deepspeed_run(world, schedule, CHANGING)
    out["constant"] = _engine_run(world, "flush", CONSTANT, False)
    out["within"] = _engine_run(world, "2bw", WITHIN, True)
    out["deepspeed-within"] = _deepspeed_run(world, "flush", WITHIN)  # the flag reaches it
    try:  # last: the group is broken afterwards
        _engine_run(world, "flush", WITHIN, False)
    except Exception as e:  # noqa: BLE001 - the line this rank prints, whatever it is
        out["error"] = (type(e).__name__, str(e))
    torch.save(out, os.path.join(outdir, f"{rank}.pt"))


def _deepspeed_reference(delayed, seqs):
    """Plain torch: Adam on the mean gradient of each batch's microbatches, of W(t) (flush) or
    W(t-1) (2bw)."""
    import copy
    torch.manual_seed(0)
    model = nn.Sequential(*[_layer() for _ in range(LAYERS)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    prev, losses, data = copy.deepcopy(model), [], _batches(seqs)()
    for t in range(len(seqs)):
        on = prev if delayed and t > 0 else model
        on.zero_grad()
        total = 0.0
        for _ in range(M):
            x, y = next(data)
            loss = _loss(on(x), y) / M
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads = [p.grad.clone() for p in on.parameters()]
        prev = copy.deepcopy(model)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
    return losses


def _close(a, b):
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("d", [2, 4])
def test_shapes_that_change_between_batches_train_exactly(d):
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, d, args=(tmp,), timeout_minutes=2)
        res = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(d)]
    for schedule in ("flush", "2bw"):
        cfg = _cfg(schedule, d)
        params, losses, _ = reference_train(cfg, _specs(), _loss, _batches(CHANGING), 4)
        ds_ref = _deepspeed_reference(schedule == "2bw", CHANGING)
        for r in res:
            run = r[("engine", schedule)]
            assert _close(run["losses"], losses), (schedule, run["losses"], losses)
            for name, value in run["params"].items():
                assert torch.allclose(value, params[name], rtol=1e-5, atol=1e-6), name
            assert _close(r[("deepspeed", schedule)], ds_ref), (schedule, r[("deepspeed",
                                                                              schedule)])
    params, losses, _ = reference_train(_cfg("2bw", d), _specs(), _loss, _batches(WITHIN), 4)
    ds_ref = _deepspeed_reference(False, WITHIN)
    for r in res:  # dynamic_shape: a shape may change at any microbatch
        assert _close(r["deepspeed-within"], ds_ref), r["deepspeed-within"]
        assert _close(r["within"]["losses"], losses)
        for name, value in r["within"]["params"].items():
            assert torch.allclose(value, params[name], rtol=1e-5, atol=1e-6), name
    # the p2p tensors per rank: the handshake, then one per activation and per gradient; a
    # change of shape adds one notice per change (2 at batches 1, 2 and 3: 3 notices)
    for r in res:
        s, mbs = r["constant"]["stage"], 4 * M
        acts_out, grads_out = (s < d - 1) * (1 + mbs), (s > 0) * mbs
        acts_in, grads_in = (s > 0) * (1 + mbs), (s < d - 1) * mbs
        assert r["constant"]["ops"] == (acts_out + grads_out, acts_in + grads_in), (s, r)
        changed = r[("engine", "flush")]["ops"]
        assert changed == (acts_out + grads_out + 3 * (s < d - 1),
                           acts_in + grads_in + 3 * (s > 0)), (s, changed)
    # without dynamic_shape a change within a batch: one line on every rank, the cause on the
    # first stage, the lost neighbour on the others
    kind, line = res[0]["error"]
    assert kind == "ShapeChangeError" and "\n" not in line and "dynamic_shape=True" in line, line
    assert "changed within a batch" in line and "(2, 8, 16)" in line and "(2, 32, 16)" in line
    for r in res[1:]:
        kind, line = r["error"]
        assert kind == "PeerError" and "\n" not in line and "lost rank" in line, line
