"""DeepSpeed drop-in on gloo processes: the example model (examples/deepspeed_style/train.py)
through `megatron_2bw.initialize` with the 2BW schedule: tied copies stay bitwise equal,
eval_batch between train batches changes nothing, checkpoints resume under another stage count."""
import os
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "deepspeed_style"))

import megatron_2bw as deepspeed  # noqa: E402
import train as example  # noqa: E402
from megatron_2bw.training.spawn import spawn  # noqa: E402


def micro_batches(micro, start=0):
    loader = torch.utils.data.DataLoader(example.token_dataset(), batch_size=micro)
    it = deepspeed.utils.RepeatingLoader(loader)
    for _ in range(start):
        next(it)
    return it


def engine(num_stages, schedule="2bw", micro=2, accumulation=2, recompute=0, **kw):
    torch.manual_seed(0)
    net = example.build_model(deepspeed, num_stages, **kw)
    config = example.ds_config(schedule, micro, accumulation, steps_per_print=1000)
    config["pipeline"]["activation_checkpoint_interval"] = recompute
    eng, _, _, _ = deepspeed.initialize(model=net, config=config)
    return net, eng


def _save(obj, outdir, rank):
    torch.save(obj, os.path.join(outdir, f"{rank}.pt"))


def _load_all(outdir, world):
    return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world)]


# -- tied weights -----------------------------------------------------------------------------------
def _tied_worker(rank, world, outdir):
    net, eng = engine(2)
    it = micro_batches(2, start=eng.grid.get_data_parallel_rank() * 100)
    losses = [eng.train_batch(it).item() for _ in range(5)]
    _save({"stage": eng.stage_id, "dp": eng.grid.get_data_parallel_rank(), "losses": losses,
           "tied": {k: p.detach().clone() for k, p in net.tied_sync_params()},
           "state": {k: v.clone() for k, v in eng.fp32_state().items()}}, outdir, rank)


def test_tied_copies_bitwise_equal_after_2bw_training():
    with tempfile.TemporaryDirectory() as d:
        spawn(_tied_worker, 4, args=(d,), timeout_minutes=2)
        res = _load_all(d, 4)
    copies = [r["tied"]["embed"] for r in res]
    assert len(copies) == 4  # first and last stage of both data-parallel replicas
    assert all(torch.equal(c, copies[0]) for c in copies)
    first = next(r for r in res if r["stage"] == 0)
    assert torch.equal(first["state"]["layers.0.layer.tok.weight"], copies[0])
    for stage in (0, 1):
        a, b = [r["state"] for r in res if r["stage"] == stage]
        assert all(torch.equal(a[k], b[k]) for k in a)  # data-parallel replicas agree
    assert all(r["losses"] == res[0]["losses"] for r in res)  # every rank reports the loss
    assert res[0]["losses"][-1] < res[0]["losses"][0]


# -- eval_batch between 2BW train batches --------------------------------------------------------
def _eval_worker(rank, world, outdir):
    out = {}
    for with_eval in (False, True):
        net, eng = engine(2, accumulation=3)
        it = micro_batches(2)
        losses, evals = [], []
        for t in range(6):
            losses.append(eng.train_batch(it).item())
            if with_eval:
                n = (1, 2, 5)[t % 3]
                evals.append(eng.eval_batch(micro_batches(2, start=200), num_micro_batches=n).item())
                again = eng.eval_batch(micro_batches(2, start=200), num_micro_batches=n).item()
                assert again == evals[-1]
        out[with_eval] = losses
        out["evals"] = evals
    net, eng = engine(2, accumulation=3, recompute=2)  # activation checkpointing changes nothing
    it = micro_batches(2)
    out["recompute"] = [eng.train_batch(it).item() for _ in range(6)]
    outputs = eng.eval_batch(micro_batches(2, start=200), compute_loss=False, reduce_output=None,
                             num_micro_batches=3)
    logits = eng.eval_batch(micro_batches(2, start=200), return_logits=True)
    out["outputs"] = None if outputs is None else [o.shape for o in outputs]
    out["logits"] = logits[1].shape if logits[1] is not None else None
    out["loss_with_logits"] = float(logits[0])
    out["last"] = eng.is_last_stage()
    _save(out, outdir, rank)


def test_eval_between_2bw_batches_leaves_train_losses_identical():
    with tempfile.TemporaryDirectory() as d:
        spawn(_eval_worker, 2, args=(d,), timeout_minutes=2)
        res = _load_all(d, 2)
    for r in res:
        assert r[True] == r[False], "evaluation must not disturb the in-flight 2BW state"
        assert r["recompute"] == pytest.approx(r[False], abs=1e-6)
        assert all(torch.isfinite(torch.tensor(r["evals"])))
    assert res[0]["evals"] == res[1]["evals"]  # the eval loss is on every rank
    last = next(r for r in res if r["last"])
    first = next(r for r in res if not r["last"])
    assert last["outputs"] == [torch.Size([2, 16, 128])] * 3 and first["outputs"] is None
    assert last["logits"] == torch.Size([2, 16, 128]) and first["logits"] is None


# -- checkpoints ---------------------------------------------------------------------------------------
def _ckpt_worker(rank, world, num_stages, ckdir, mode, outdir):
    net, eng = engine(num_stages, accumulation=4)
    out = {}
    if mode == "train":
        it = micro_batches(2)
        losses = []
        for t in range(7):
            losses.append(eng.train_batch(it).item())
            if t == 3:
                eng.save_checkpoint(ckdir, client_state={"epoch": 3})
        out["losses"] = losses
    else:
        path, client = eng.load_checkpoint(ckdir, load_module_only=(mode == "module_only"))
        out["client"], out["steps"] = client, eng.global_steps
        out["state"] = {k: v.clone() for k, v in eng.fp32_state().items()}
        it = micro_batches(2, start=4 * 4)  # the data of batch 4 on
        out["losses"] = [eng.train_batch(it).item() for _ in range(3)]
    _save(out, outdir, rank)


def test_checkpoint_layout_and_resume_under_another_stage_count():
    with tempfile.TemporaryDirectory() as ck, tempfile.TemporaryDirectory() as d:
        spawn(_ckpt_worker, 2, args=(2, ck, "train", d), timeout_minutes=2)
        ref = _load_all(d, 2)[0]["losses"]
        with open(os.path.join(ck, "latest")) as f:
            assert f.read() == "global_step4"
        assert sorted(os.listdir(ck)) == ["global_step4", "latest"]  # no temporary left
        files = sorted(os.listdir(os.path.join(ck, "global_step4")))
        names = [f"layer_{i:02d}-model_states.pt" for i in range(7)] + \
            ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
        assert files == sorted(names + [n + ".sha256" for n in names])  # each with its checksum
        layer0 = torch.load(os.path.join(ck, "global_step4", "layer_00-model_states.pt"))
        assert sorted(layer0) == ["pos.weight", "tok.weight"]
        # the same layout: bitwise the same continuation
        spawn(_ckpt_worker, 2, args=(2, ck, "load", d), timeout_minutes=2)
        same = _load_all(d, 2)
        assert same[0]["losses"] == ref[4:] and same[0]["steps"] == 4
        assert same[0]["client"] == {"epoch": 3}
        # one stage: per-layer weights, optimizer state and the 2BW previous version re-sharded
        spawn(_ckpt_worker, 1, args=(1, ck, "load", d), timeout_minutes=2)
        one = _load_all(d, 1)[0]
        assert one["losses"] == pytest.approx(ref[4:], abs=1e-5)
        assert torch.equal(one["state"]["layers.0.layer.tok.weight"], layer0["tok.weight"])
        assert torch.equal(one["state"]["layers.0.layer.pos.weight"], layer0["pos.weight"])
        # weights only: a fresh optimizer, so the continuation differs but starts from the weights
        spawn(_ckpt_worker, 1, args=(1, ck, "module_only", d), timeout_minutes=2)
        mod = _load_all(d, 1)[0]
        assert mod["client"] == {} and mod["steps"] == 0
        assert torch.equal(mod["state"]["layers.0.layer.tok.weight"], layer0["tok.weight"])


# -- a data iterator that runs dry ---------------------------------------------------------------------
def _dry_worker(rank, world, outdir):
    out = {}
    for schedule in ("flush", "2bw"):
        _, eng = engine(1, schedule=schedule)
        one_batch = [next(micro_batches(2, start=k)) for k in range(2)]  # m = 2 microbatches
        try:
            eng.train_batch(iter(one_batch))
            out[schedule] = "ok"
        except RuntimeError as e:
            out[schedule] = str(e)
    _save(out, outdir, rank)


def test_a_schedule_that_reads_ahead_says_so_when_the_data_runs_out():
    with tempfile.TemporaryDirectory() as d:
        spawn(_dry_worker, 1, args=(d,), timeout_minutes=2)
        out = _load_all(d, 1)[0]
    assert out["flush"] == "ok"  # a flushing schedule reads exactly its batch
    assert out["2bw"].startswith("train_batch: the data iterator ran out. 2bw reads the first "
                                 "microbatches of the next batch ahead: pass one long iterator")
