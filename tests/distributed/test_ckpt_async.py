"""--async-save (issue 18): the write runs in the background from host copies, a save is published
(`latest` moved) only once every rank's files are durable, at the same boundary everywhere; a
second save and the end of training wait for the one in flight; a rank killed while writing
leaves the previous checkpoint as `latest`; resuming from asynchronous saves is bitwise exact;
a full disk is one line naming ENOSPC."""
import builtins
import os
import threading

import pytest
import torch
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from fault_hooks import InjectedFault
from megatron_2bw.checkpoint.api import load_checkpoint, preflight
from megatron_2bw.checkpoint.dist import storage
from megatron_2bw.checkpoint.files import CheckpointError, latest_iteration, temporary_files
from megatron_2bw.checkpoint.saver import AGREEMENT_DELAY, Checkpointer
from megatron_2bw.config.build import build_config
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.faults import FaultHooks
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.build import build_engine, mock_batches
from test_resume import make_cfg, run


def _one_rank(argv=()):
    flags = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 "
             "--seq-length 16 --micro-batch-size 2 --global-batch-size 4 --train-iters 20").split()
    cfg = build_config(build_parser("gpt").parse_args(flags + list(argv)), "gpt", 1).config
    grid = ProcessGrid.from_config(cfg, 0, 1).init_groups()
    return build_engine(cfg, grid, "cpu"), cfg, grid


class _Gate(FaultHooks):
    """Holds every checkpoint write until `release`."""

    def __init__(self):
        self.open = threading.Event()

    def during_save(self, grid, iteration, path):
        assert threading.current_thread() is not threading.main_thread()
        assert self.open.wait(60)


def test_a_save_is_published_at_the_boundary_after_every_write_is_done(tmp_path):
    engine, cfg, grid = _one_rank(["--save", str(tmp_path), "--async-save"])
    gate, lines = _Gate(), []
    saver = Checkpointer(cfg, grid, engine, gate, log=lines.append)
    data = mock_batches(cfg, 1, 0)
    for _ in range(2):
        engine.train_batch(data)
    saver.save()  # returns with the write held by the gate
    published = None
    for it in range(3, 12):
        engine.train_batch(data)
        if it == 6:
            gate.open.set()
            saver.pending._thread.join()  # done before boundary 6 lowers the flag
        saver.poll()
        if published is None and latest_iteration(str(tmp_path)) == 2:
            published = it
    # the flag lowered at boundary 6 rides in batch 7 and is read after batch 8
    assert published == 6 + 2 >= 2 + AGREEMENT_DELAY
    assert [x for x in lines if x.startswith("saved iteration")] == [
        f"saved iteration 2 in {tmp_path}/iter_0000002: written in the background while "
        "training went on, published at iteration 8"]
    assert lines[0] == f"saving checkpoint at iteration 2 to {tmp_path}"  # Megatron's lines too
    assert lines[1].startswith(f"successfully saved checkpoint at iteration 2 to {tmp_path} (")


def test_a_second_save_and_the_end_wait_for_the_one_in_flight(tmp_path):
    engine, cfg, grid = _one_rank(["--save", str(tmp_path), "--async-save"])
    saver = Checkpointer(cfg, grid, engine)
    data = mock_batches(cfg, 1, 0)
    engine.train_batch(data)
    saver.save()
    engine.train_batch(data)
    saver.save()  # publishes iteration 1 first
    assert latest_iteration(str(tmp_path)) == 1
    saver.wait()
    assert latest_iteration(str(tmp_path)) == 2 and temporary_files(str(tmp_path)) == []
    fresh, _, _ = _one_rank(["--save", str(tmp_path), "--async-save"])
    assert load_checkpoint(str(tmp_path), fresh, cfg, grid) == 2
    assert torch.equal(fresh.state_dict()["newest"], engine.state_dict()["newest"])


def test_a_full_disk_is_one_line_naming_enospc_and_keeps_the_previous_one(tmp_path, monkeypatch):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    engine, cfg, grid = _one_rank(["--save", str(tmp_path), "--async-save"])
    saver = Checkpointer(cfg, grid, engine)
    data = mock_batches(cfg, 1, 0)
    engine.train_batch(data)
    saver.save(wait=True)
    engine.train_batch(data)
    monkeypatch.setattr(storage, "open", lambda path, mode: builtins.open("/dev/full", mode),
                        raising=False)
    saver.save()
    with pytest.raises(CheckpointError) as e:
        saver.wait()
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"cannot write checkpoint file {tmp_path}/.tmp-iter_0000002/"
                                   "__0_0.distcp: No space left on device (ENOSPC) after ")
    assert str(e.value).endswith(f"the previous checkpoint (iteration 1) in {tmp_path} is "
                                 "intact")
    assert latest_iteration(str(tmp_path)) == 1 and temporary_files(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_resume_from_async_saves_is_bitwise_identical(tmp_path):
    d, ck = str(tmp_path), str(tmp_path / "ck")
    full = run(make_cfg(["--train-iters", "10"]), f"{d}/full")
    first = run(make_cfg(["--train-iters", "10", "--save", ck, "--async-save",
                          "--save-interval", "4", "--exit-interval", "9"]), f"{d}/first",
                log=f"{d}/log")
    assert first == full[:9] and latest_iteration(ck) == 9
    published = [line for line in open(f"{d}/log.1").read().splitlines()
                 if line.startswith("saved iteration")]
    assert [line.split(":")[0] for line in published] == [
        f"saved iteration {i} in {ck}/iter_000000{i}" for i in (4, 8, 9)]
    rest = run(make_cfg(["--train-iters", "10", "--save", ck, "--load", ck, "--async-save"]),
               f"{d}/rest")
    assert rest == full[9:]


def test_a_rank_killed_while_writing_in_the_background_leaves_the_previous_checkpoint(tmp_path):
    d, ck = str(tmp_path), str(tmp_path / "ck")
    full = run(make_cfg(["--train-iters", "6"]), f"{d}/full")
    flags = ["--train-iters", "6", "--save", ck, "--async-save"]
    with pytest.raises(ProcessExitedException, match="signal SIGKILL"):
        run(make_cfg(flags + ["--save-interval", "2"]), f"{d}/killed",
            hooks=InjectedFault("kill-in-save", 1, 4))
    assert latest_iteration(ck) == 2, "latest still names the last complete checkpoint"
    assert [os.path.basename(p) for p in temporary_files(ck)] == [".tmp-iter_0000004"]
    assert os.path.exists(f"{ck}/.tmp-iter_0000004/.tmp-partial")
    cfg = make_cfg(flags + ["--load", ck])
    assert preflight(cfg.train, log=lambda line: None) == 2
    assert len(temporary_files(ck)) == 1, "the checks before any process group write nothing"
    assert run(cfg, f"{d}/rest") == full[2:]
    assert temporary_files(ck) == [], "rank 0 removes the leftover once every rank started"


class _HoldingIteration2(InjectedFault):
    """A fault (fault_hooks.py: `kind` on `rank` at `iteration`), and every rank's write of
    iteration 2 held until its iteration 3 is done."""

    def __init__(self, kind, rank, iteration):
        super().__init__(kind, rank, iteration)
        self.open = None

    def after_iteration(self, grid, iteration):
        if self.open is None:
            self.open = threading.Event()
        super().after_iteration(grid, iteration)
        if iteration == 3:
            self.open.set()

    def during_save(self, grid, iteration, path):
        if iteration == 2:
            assert self.open.wait(60)


def test_a_preemption_waits_for_the_save_in_flight(tmp_path):
    d, ck = str(tmp_path), str(tmp_path / "ck")
    full = run(make_cfg(["--train-iters", "6"]), f"{d}/full")
    flags = ["--train-iters", "6", "--save", ck, "--async-save", "--save-interval", "2"]
    first = run(make_cfg(flags), f"{d}/first", hooks=_HoldingIteration2("sigterm", 0, 1),
                log=f"{d}/log")
    # the signal after iteration 1 is acted on after iteration 3 (pipeline/flags.py), while
    # iteration 2's write is still in flight: it is published first, then iteration 3 is saved
    assert first == full[:3] and latest_iteration(ck) == 3
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000003",
                                      "latest_checkpointed_iteration.txt"]
    lines = [line for line in open(f"{d}/log.1").read().splitlines()  # the reporting rank
             if line.startswith(("saved iteration", "a preemption signal"))]
    assert lines == [
        f"saved iteration 2 in {ck}/iter_0000002: written in the background while training went "
        "on, published at iteration 3",
        f"saved iteration 3 in {ck}/iter_0000003: written in the background while training went "
        "on, published at iteration 3",
        f"a preemption signal to another rank: saved a checkpoint at iteration 3 in {ck}; exiting "
        "(resume with --load)"]
    assert run(make_cfg(flags + ["--load", ck]), f"{d}/rest") == full[3:]


def test_a_numerics_stop_publishes_the_save_in_flight_and_names_it(tmp_path):
    ck = str(tmp_path / "ck")
    flags = ["--train-iters", "6", "--save", ck, "--async-save", "--save-interval", "2"]
    # the hook poisons the forwards from the window of iteration 3 on, which holds forwards of
    # iterations 3 and 4 (2BW): either is the first non-finite loss
    with pytest.raises(ProcessRaisedException, match=r"loss is nan at iteration [34] .* resume "
                                                     f"from iteration 2 in {ck}$"):
        run(make_cfg(flags), str(tmp_path / "x"), hooks=_HoldingIteration2("nan", 1, 3))
    assert latest_iteration(ck) == 2 and temporary_files(ck) == []
