"""2BW staleness compensation (`--2bw-compensation`, pipeline/compensation.py): every method equals
its single-process reference (megatron_2bw/testing/reference.py) on real gloo processes at
(t,d,w) in {(1,2,1), (1,2,2), (1,4,1), (2,2,1)}; the optimizer's predictions are pure; the
comparison fails for an engine that ignores the compensation; evaluation between batches, mixed
precision and the memory model; one-line errors for what does not apply."""
import copy

import pytest
import torch

from matrix import matrix
from megatron_2bw.config.build import build_config
from megatron_2bw.pipeline.compensation import Compensator
from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.pipeline.weights import VersionedWeights
from megatron_2bw.planner.cost_model import state_bytes
from megatron_2bw.pretrain import build_parser
from megatron_2bw.schedule.compensation_methods import keeps_master, method_names
from megatron_2bw.testing.reference import _predicted, _spike
from megatron_2bw.testing.verify import parse, run
from test_engine_units import _model, stepped

TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 5 --clip-grad 0.3 --timeout-minutes 1").split()
COMPENSATED = [m for m in method_names() if m != "none"]


def flags(method, t, d, w, *extra):
    return (["--schedule", "2bw", "--2bw-compensation", method,
             "--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(d),
             "--data-parallel-size", str(w), "--global-batch-size", str(2 * max(d, 4) * w)]
            + TINY + list(extra))


# -- the engine equals the reference ---------------------------------------------------------------
@pytest.mark.parametrize("method,t,d,w", matrix(
    [(m, *layout) for m in COMPENSATED for layout in [(1, 2, 1), (1, 2, 2), (1, 4, 1), (2, 2, 1)]],
    default=[("predict", 1, 2, 1), ("predict-spike", 1, 2, 2), ("predict-nesterov", 1, 4, 1),
             ("predict-nesterov", 2, 2, 1)]))
def test_compensated_2bw_matches_its_reference(method, t, d, w):
    cfg, _ = parse(flags(method, t, d, w))
    rep = run(cfg, timeout_minutes=1)
    assert rep.passed(1e-5), rep
    assert rep.clipped_steps > 0 and rep.tied_equal and rep.replicas_equal


@pytest.mark.parametrize("method", matrix([(m,) for m in COMPENSATED],
                                          default=[("predict-nesterov",)]))
def test_compensated_2bw_with_the_distributed_optimizer_matches_its_reference(method):
    """--use-distributed-optimizer at d2w2 (fp32: the predict master is sharded too; a tied
    region of its own on both stages): each rank predicts (and spikes) its shard and the slot is
    all-gathered; evaluation between batches shows the real weights through the same gather."""
    cfg, _ = parse(flags(method, 1, 2, 2, "--use-distributed-optimizer"))
    assert cfg.parallel.distributed_optimizer
    rep = run(cfg, timeout_minutes=1, eval_interval=2)
    assert rep.passed(1e-5) and not rep.problems, rep
    assert rep.clipped_steps > 0 and rep.tied_equal and rep.replicas_equal


def test_predict_with_sgd_momentum_and_lr_schedule_matches_reference():
    cfg, _ = parse(flags("predict", 1, 2, 2, "--optimizer", "sgd", "--lr", "0.05",
                         "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
                         "--weight-decay", "0.1"))
    assert run(cfg, timeout_minutes=1).passed(1e-5)


class IgnoresCompensation(PipelineEngine):
    """A broken engine, defined here and passed in: it keeps the master buffer but publishes
    the real weights instead of the prediction (plain 2BW behind a `predict` flag)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.stepper.compensation
        self.stepper.compensation = Compensator("none", c.optimizer, c.w, c.lr)


@pytest.mark.parametrize("method", matrix([(m,) for m in COMPENSATED], default=[("predict",)]))
def test_checker_catches_an_engine_that_ignores_the_compensation(method):
    cfg, _ = parse(flags(method, 1, 2, 1))
    rep = run(cfg, timeout_minutes=1, engine_class=IgnoresCompensation)
    assert not rep.passed(1e-5) and rep.max_rel_diff > 1e-4, rep


@pytest.mark.parametrize("method", ["predict", "predict-nesterov"])
def test_evaluation_between_batches_shows_real_weights_and_keeps_prediction(method):
    """eval_batch asks for the newest module (the real W(t), not the prediction in its slot);
    the next batch must run on the prediction again (nesterov: from the kept gradient, the
    gradient buffer being zero by then): losses and weights stay exact."""
    cfg, _ = parse(flags(method, 1, 2, 2))
    rep = run(cfg, timeout_minutes=1, eval_interval=2)
    assert rep.passed(1e-5) and not rep.problems, rep


@pytest.mark.parametrize("precision,rtol,extra", [
    ("--bf16", 3e-2, ()), ("--fp16", 1e-2, ()),
    ("--bf16", 3e-2, ("--use-distributed-optimizer",))], ids=["bf16", "fp16", "bf16-distopt"])
def test_mixed_precision_predict_tracks_fp32_reference(precision, rtol, extra):
    cfg, _ = parse(flags("predict", 1, 2, 2, precision, "--optimizer", "sgd", "--lr", "0.05",
                         "--clip-grad", "0", *extra))
    rep = run(cfg, timeout_minutes=1)
    assert rep.passed(rtol), rep


# -- the optimizer's pure predictions ------------------------------------------------------------
@pytest.mark.parametrize("name,nesterov", [("adam", False), ("sgd", False), ("adam", True)],
                         ids=["adam", "sgd", "adam-nesterov"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_predict_is_pure_and_equals_the_torch_state_formula(name, nesterov, dtype):
    """nesterov: the formula with b1 * m + (1 - b1) * g, g the torch parameters' .grad (the last
    step's gradient), from the optimizer's kept copy of it."""
    w, opt, ref, ref_opt, _ = stepped(name, 3, keep_grad=nesterov)
    before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state_dict().items()}
    src = w.slots[0].clone()
    out = torch.empty(w.numel, dtype=dtype)
    opt.predict(src, out, 0.02, nesterov=nesterov)
    after = opt.state_dict()
    assert all(torch.equal(before[k], after[k]) if torch.is_tensor(before[k])
               else before[k] == after[k] for k in before), "predict changed the state"
    assert torch.equal(src, w.slots[0])
    expected = _predicted(ref, ref_opt, 0.02, nesterov)
    mine = w.named_tensors(out)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for n, _ in ref.named_parameters():
        torch.testing.assert_close(mine[n].float(), expected[n], rtol=tol, atol=tol)
    assert not torch.allclose(out.float(), src), "the prediction moves the weights"
    if nesterov:
        plain = torch.empty_like(out)
        opt.predict(src, plain, 0.02)
        assert not torch.allclose(out.float(), plain.float()), "the gradient moves it further"


def test_nesterov_predict_needs_the_kept_gradient_and_adam():
    _, adam, *_ = stepped("adam", 1)
    _, sgd, *_ = stepped("sgd", 1)
    x = torch.zeros(adam.numel)
    with pytest.raises(ValueError, match=r"^predict\(nesterov=True\) reads the latest gradient: "
                                         "make the optimizer with keep_grad=True$"):
        adam.predict(x, x.clone(), 0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"defined for Adam only, not SGD"):
        sgd.predict(x, x.clone(), 0.1, nesterov=True)


def test_kept_gradient_is_state_and_loads_without_it_as_the_plain_prediction():
    """last_grad is the latest step's gradient and round-trips through state_dict; a state
    without it (another method, an older checkpoint) loads as last_grad = exp_avg, whose
    nesterov prediction is bitwise `predict`'s; a state with it loads into an optimizer
    without it."""
    w, opt, _, _, flat = stepped("adam", 3, keep_grad=True)
    state = opt.state_dict()
    assert torch.equal(state["last_grad"], flat)
    _, plain, *_ = stepped("adam", 3)
    assert "last_grad" not in plain.state_dict()
    plain.load_state_dict(state)  # the extra key is ignored
    _, other, *_ = stepped("adam", 1, keep_grad=True)
    other.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()})
    assert all(torch.equal(other.state_dict()[k], state[k]) for k in ("last_grad", "exp_avg"))
    other.load_state_dict(plain.state_dict())
    assert torch.equal(other.last_grad, state["exp_avg"])
    src, nest, ref = w.slots[0], torch.empty_like(w.slots[0]), torch.empty_like(w.slots[0])
    other.predict(src, nest, 0.02, nesterov=True)
    plain.predict(src, ref, 0.02)
    assert torch.equal(nest, ref)


def test_predict_before_any_step_is_the_weights():
    w, opt, *_ = stepped("adam", steps=0)
    out = torch.empty_like(w.slots[0])
    opt.predict(w.slots[0], out, 0.1)
    assert torch.equal(out, w.slots[0])


def test_spike_equals_the_torch_state_formula_and_predicts_from_the_corrected_weights():
    w, opt, ref, ref_opt, flat = stepped("adam", 3)
    for n, p in ref.named_parameters():  # the gradient of the last step, as stepped left it
        p.grad = w.named_tensors(flat)[n].clone()
    fresh = copy.deepcopy(opt)
    out = torch.empty_like(w.slots[0])
    opt.predict(w.slots[0], out, 0.02, spike=(flat, 0.01))
    _spike(ref_opt, 0.01)
    mine = w.named_tensors(w.slots[0])
    for n, p in ref.named_parameters():
        torch.testing.assert_close(mine[n], p.detach(), rtol=1e-6, atol=1e-7)
    plain = torch.empty_like(out)
    fresh.predict(w.slots[0], plain, 0.02)  # one denominator for both: the same bits
    assert torch.equal(out, plain)
    theirs = fresh.state_dict()
    assert all(torch.equal(v, theirs[k]) if torch.is_tensor(v) else v == theirs[k]
               for k, v in opt.state_dict().items())


# -- memory ---------------------------------------------------------------------------------------
def test_fp32_predict_adds_one_stage_buffer_and_mixed_precision_none():
    m = _model()
    plain = VersionedWeights(copy.deepcopy(m), 2, "fp32", "cpu", tied=m.tied)
    sep = VersionedWeights(copy.deepcopy(m), 2, "fp32", "cpu", tied=m.tied,
                           separate_master=keeps_master("fp32", "predict"))
    assert plain.master is None and sep.master.numel() == sep.numel
    assert keeps_master("fp32", "predict-spike") and not keeps_master("fp32", "none")
    n = 1000
    for dtype in ("bf16", "fp16"):
        assert state_bytes(n, 2, dtype, "adam", compensation="predict") == \
            state_bytes(n, 2, dtype, "adam")
    extra = {k: state_bytes(n, 2, "fp32", "adam", compensation="predict")[k] - v
             for k, v in state_bytes(n, 2, "fp32", "adam").items()}
    assert extra == {"weights": 0, "master": 4 * n, "grads": 0, "model_grad": 0, "optimizer": 0}
    assert state_bytes(n, 2, "fp32", "adam", compensation="none") == \
        state_bytes(n, 2, "fp32", "adam")


def test_memory_model_counts_the_kept_gradient_as_optimizer_state():
    """predict-nesterov: predict's fp32 master plus one fp32 copy in the optimizer state (the
    kept gradient), sharded with it under the distributed optimizer; in bf16 only the latter."""
    n, w = 1001, 4
    for dtype in ("fp32", "bf16"):
        extra = {k: state_bytes(n, 2, dtype, "adam", compensation="predict-nesterov")[k] - v
                 for k, v in state_bytes(n, 2, dtype, "adam", compensation="predict").items()}
        assert extra == {"weights": 0, "master": 0, "grads": 0, "model_grad": 0,
                         "optimizer": 4 * n}, dtype
    mem = state_bytes(n, 2, "fp32", "adam", shards=w, compensation="predict-nesterov")
    padded = -(-n // w) * w
    assert mem["master"] == 4 * padded // w and mem["optimizer"] == 12 * padded // w


def test_memory_model_counts_the_compensation_master_and_the_distributed_optimizer_together():
    """The two terms compose: the predict master is one more fp32 buffer, sharded like the
    distributed optimizer's master and state (1/w of the padded stage)."""
    n, w = 1001, 4
    mem = state_bytes(n, 2, "fp32", "adam", shards=w, compensation="predict")
    padded = -(-n // w) * w
    assert mem["master"] == 4 * padded // w and mem["optimizer"] == 8 * padded // w
    assert mem["weights"] == 2 * 4 * padded
    assert state_bytes(n, 2, "fp32", "adam", shards=w)["master"] == 0
    assert state_bytes(n, 2, "bf16", "adam", shards=w, compensation="predict") == \
        state_bytes(n, 2, "bf16", "adam", shards=w)


# -- one-line errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,match", [
    (["--pipeline-schedule", "flush", "--2bw-compensation", "predict"],
     r"^--2bw-compensation predict compensates one-step-stale weights, which "
     r"--pipeline-schedule flush does not have: use --pipeline-schedule 2bw"),
    (["--2bw-compensation", "predict-spike", "--optimizer", "sgd"],
     r"^--2bw-compensation predict-spike is defined for --optimizer adam, not sgd"),
    (["--2bw-compensation", "predict-nesterov", "--optimizer", "sgd"],
     r"^--2bw-compensation predict-nesterov is defined for --optimizer adam, not sgd: use "
     r"--2bw-compensation predict$"),
    (["--2bw-compensation", "predict", "--optimizer", "sgd", "--sgd-momentum", "0"],
     r"^--2bw-compensation predict with SGD predicts from the momentum buffer: set "
     r"--sgd-momentum > 0"),
])
def test_compensation_that_does_not_apply_is_a_one_line_error(argv, match):
    from megatron_2bw.config import ConfigError
    args = build_parser("gpt").parse_args(["--mock-data"] + argv)
    with pytest.raises(ConfigError, match=match) as e:
        build_config(args, "gpt", 1)
    assert "\n" not in str(e.value)


def test_unknown_compensation_is_a_flag_error(capsys):
    with pytest.raises(SystemExit):
        build_parser("gpt").parse_args(["--2bw-compensation", "guess"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--2bw-compensation" in err[0] and "predict" in err[0]


def test_compensation_flag_fixes_the_schedule_for_the_planner():
    argv = ["--mock-data", "--2bw-compensation", "predict"]
    args = build_parser("gpt").parse_args(argv)
    cfg = build_config(args, "gpt", 1, typed={"--2bw-compensation"}).config
    assert cfg.compensation == "predict"
    assert cfg.source_of("schedule") == "--2bw-compensation predict"
