"""2BW compensation done in the engine's waits (pipeline/compensation.py, "Time"): the prediction
in chunks changes no bit, a pending prediction is completed before anything reads what it writes
(the next batch's forward on its slot, the next step, views, checkpoints), and the engine works on
it while a receive or a collective is in flight."""
import copy
import functools

import pytest
import torch

from megatron_2bw.config import BatchConfig, Config, ModelConfig, OptimizerConfig, TrainConfig
from megatron_2bw.optim import optimizer as optim
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.batch_step import _wait
from megatron_2bw.pipeline.interpreter import Interpreter
from megatron_2bw.schedule import actions as A
from megatron_2bw.schedule.compensation_methods import method_names
from megatron_2bw.training.build import build_engine, mock_batches
import test_engine_units
from test_engine_units import stepped

COMPENSATED = [m for m in method_names() if m != "none"]


# -- the optimizer: chunks change no bit ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant,kernel", [  # the native kernel is Adam's
    (v, "torch") for v in ("adam", "nesterov", "spike", "sgd")] + [
    (v, "native") for v in ("adam", "nesterov", "spike")])
def test_predict_in_chunks_changes_no_bit_and_tiles_the_buffer(monkeypatch, variant, dtype,
                                                              kernel):
    name = "sgd" if variant == "sgd" else "adam"
    if kernel == "native":  # asked for (--optimizer-impl native); the default is torch's
        if optim.native.library() is None:
            pytest.skip("the native kernel (Adam's) is built where there is a C compiler")
        monkeypatch.setattr(test_engine_units, "make_optimizer",
                            functools.partial(optim.make_optimizer, impl="native"))
    w, opt, _, _, flat = stepped(name, 3, keep_grad=variant == "nesterov")
    assert (opt.impl == "native") == (kernel == "native")
    assert 0 < w.decay_end < w.numel  # a chunk straddles the end of the decayed range below
    kw = {"nesterov": variant == "nesterov",
          "spike": (flat, 0.01) if variant == "spike" else None}
    whole_src, whole = w.slots[0].clone(), torch.empty(w.numel, dtype=dtype)
    ranges = list(opt.predict_chunks(whole_src, whole, 0.02, **kw))
    assert ranges == [(0, w.numel)]  # the tiny stage is one chunk on a CPU
    monkeypatch.setattr(optim, "chunk_elements", lambda device, numel: 7)
    src, out = w.slots[0].clone(), torch.empty(w.numel, dtype=dtype)
    ranges = list(opt.predict_chunks(src, out, 0.02, **kw))
    assert ranges[0][0] == 0 and ranges[-1][1] == w.numel and len(ranges) == -(-w.numel // 7)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert torch.equal(out, whole) and torch.equal(src, whole_src)
    assert not torch.equal(out.float(), w.slots[0])


def test_predict_chunk_size_is_small_on_a_cpu_and_bounded_elsewhere():
    assert optim.chunk_elements("cpu", 10 ** 9) == 2 ** 18
    assert optim.chunk_elements("cpu", 100) == 100
    assert optim.chunk_elements("meta", 10 ** 9) == 2 ** 24


# -- the engine: deferred equals immediate, bit for bit ---------------------------------------------
def _engine(method, impl="auto"):
    """A one-stage 2BW engine with compensation `method`; `impl` (--optimizer-impl): the default
    is torch's kernels, whose prediction the engine defers (native predicts in the step)."""
    cfg = Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   vocab_size=64, seq_length=8),
                 batch=BatchConfig(micro_batch_size=2, global_batch_size=4),
                 optimizer=OptimizerConfig(impl=impl), train=TrainConfig(train_iters=8),
                 schedule="2bw", compensation=method).validate(1)
    return build_engine(cfg, ProcessGrid(1, 1, 1, rank=0), "cpu"), cfg


@pytest.mark.parametrize("method", COMPENSATED)
def test_deferred_prediction_equals_the_immediate_one_through_views_and_checkpoints(
        method):
    """One stage, CPU: the prediction S(t) publishes stays pending through batch t + 1 (it writes
    the other slot) until S(t + 1) needs it done; evaluation views, a checkpoint's state and a
    load in between complete it first. Every loss and weight equals an engine that predicts at
    once (predict-spike: the pending work also owns the gradient it reads)."""
    deferred, cfg = _engine(method)
    at_once, _ = _engine(method)
    at_once.stepper.compensation.defer = False
    assert deferred.stepper.compensation.defer
    feeds = [mock_batches(cfg, 1, 0) for _ in range(2)]
    pending = 0
    for t in range(6):
        losses = [e.train_batch(f) for e, f in zip((deferred, at_once), feeds)]
        assert torch.equal(*losses), t
        pending += deferred.stepper.compensation.job is not None
        if t == 2:  # a view of the newest weights
            mine, theirs = deferred.module.state_dict(), at_once.module.state_dict()
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
            assert all(torch.equal(a, b) for a, b in zip(deferred.fp32_state().values(),
                                                         at_once.fp32_state().values()))
        if t == 3:  # a checkpoint's state, loaded back into both
            state = deferred.state_dict()
            theirs = at_once.state_dict()
            for k in ("newest", "previous"):
                assert torch.equal(state[k], theirs[k]), k
            deferred.load_state_dict(copy.deepcopy(state))
            at_once.load_state_dict(copy.deepcopy(theirs))
    assert pending >= 5  # the deferral was exercised
    for a, b in zip(deferred.state_dict().values(), at_once.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b)
    assert deferred.stepper.compensation.chunks_in_waits == 0  # one stage: nothing to wait for


# -- the engine works while it waits ----------------------------------------------------------------
class _Work:
    def __init__(self, polls):
        self.polls, self.waited = polls, False

    def is_completed(self):
        self.polls -= 1
        return self.polls < 0

    def wait(self):
        self.waited = True


class _Pending:
    """Pending work of `n` chunks, counting them."""

    def __init__(self, n):
        self.left, self.done = n, 0

    def __call__(self):
        if not self.left:
            return False
        self.left -= 1
        self.done += 1
        return True


def test_collective_waits_do_pending_chunks_while_in_flight():
    work, pending = _Work(polls=3), _Pending(10)
    _wait([work], "test", pending)
    assert pending.done == 3 and work.waited  # three polls in flight, then the real wait
    work, pending = _Work(polls=50), _Pending(2)
    _wait([work], "test", pending)
    assert pending.done == 2 and pending.left == 0 and work.waited  # none left: just wait


def test_receive_waits_do_pending_chunks_until_the_receive_arrives():
    class P2P:
        def __init__(self):
            self.pending, self.polls, self.waited = {(A.RECV_ACT, 0): None}, 4, []
            self.unverified = None  # no shape header receive pending (parallel/p2p.py)

        def arrived(self, key):
            self.polls -= 1
            return self.polls < 0

        def wait_recv(self, key):
            self.waited.append(key)
            self.pending.pop(key)

    it = Interpreter()
    it.p2p, pending = P2P(), _Pending(10)
    it._idle_work = pending
    it._await_input(A.Action(A.FORWARD, mb=0), None)
    assert pending.done == 4 and it.p2p.waited == [(A.RECV_ACT, 0)]


def test_a_step_completes_the_pending_prediction_before_it_changes_the_state():
    """Today's tables run the forward that reads the predicted slot before the next step; a
    table that does not must still predict from the state the prediction started from."""
    engine, cfg = _engine("predict-spike")
    feed = mock_batches(cfg, 1, 0)
    for _ in range(2):
        engine.train_batch(feed)
    comp, stepper, k = engine.stepper.compensation, engine.stepper, engine.kind
    assert comp.job is not None
    seen, step = [], stepper.optimizer.step
    stepper.optimizer.step = lambda *a: (seen.append(comp.job), step(*a))
    t = engine.iteration
    stepper.reduce(t, k.slot_of_batch(t))
    stepper.norm(t, k.slot_of_batch(t))
    stepper.step(t, k.slot_of_batch(t), k.newest_slot(t), k.step_writes_slot(t))
    assert seen == [None]
