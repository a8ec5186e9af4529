"""--decoupled-lr without processes: Megatron's schedule for the embedding and output layer
(optim/lr.py, checked against Megatron's get_lr written out here), the optimizer's segments
(optim/segments.py), every kernel stepping and predicting the decoupled ranges at their own lr
as separate optimizers at that lr would (elementwise arithmetic: bit for bit), and which ranges
of a stage's flat layout are decoupled (pipeline/weights.py)."""
import math

import pytest
import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.models.gpt import gpt_layer_specs
from megatron_2bw.models.stage import StageModule
from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.optim.optimizer import make_optimizer
from megatron_2bw.optim.segments import segments
from megatron_2bw.pipeline.weights import VersionedWeights
from megatron_2bw.testing.verify import parse
from test_fused_optim import KERNEL_OPTIMIZERS


def megatron_lr(step, max_lr, min_lr, warmup, decay, style):
    """Megatron's OptimizerParamScheduler.get_lr for one param group (init lr 0)."""
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if style == "constant":
        return max_lr
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_the_decoupled_lr_follows_megatrons_schedule_between_its_own_bounds(style):
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-5, lr_warmup_iters=3, lr_decay_iters=10,
                          lr_decay_style=style, decoupled_lr=5e-4, decoupled_min_lr=4.5e-5)
    s = LRSchedule(cfg, train_iters=12)
    for t in range(12):
        lr, dlr = s.rates(t)
        assert lr == pytest.approx(megatron_lr(t + 1, 1e-3, 1e-5, 3, 10, style), rel=1e-12)
        assert dlr == pytest.approx(megatron_lr(t + 1, 5e-4, 4.5e-5, 3, 10, style), rel=1e-12)
    assert s.rates(11)[1] == pytest.approx(4.5e-5 if style != "constant" else 5e-4)
    # without --decoupled-min-lr the decay ends at --min-lr; without --decoupled-lr: one float
    plain = LRSchedule(OptimizerConfig(lr=1e-3, min_lr=1e-5, lr_decay_style="linear",
                                       decoupled_lr=5e-4), train_iters=10)
    assert plain.rates(9) == (pytest.approx(1e-5), pytest.approx(1e-5))
    assert plain.rates(4)[1] == pytest.approx(megatron_lr(5, 5e-4, 1e-5, 0, 10, "linear"))
    assert LRSchedule(OptimizerConfig(lr=1e-3), 10).rates(3) == 1e-3


def test_segments_cut_where_the_weight_decay_or_the_lr_class_changes():
    assert segments(100, 60, 0.1) == [(0, 60, 0.1, 0), (60, 100, 0.0, 0)]
    assert segments(100, 60, 0.0) == [(0, 100, 0.0, 0)]
    assert segments(100, 60, 0.1, [(0, 20), (50, 60)]) == [
        (0, 20, 0.1, 1), (20, 50, 0.1, 0), (50, 60, 0.1, 1), (60, 100, 0.0, 0)]
    assert segments(100, 60, 0.0, [(0, 20), (20, 30)]) == [(0, 30, 0.0, 1), (30, 100, 0.0, 0)]
    assert segments(10, 6, 0.1, [(-5, 3), (8, 40)]) == [  # clamped into the buffer
        (0, 3, 0.1, 1), (3, 6, 0.1, 0), (6, 8, 0.0, 0), (8, 10, 0.0, 1)]
    assert segments(0, 0, 0.1, [(0, 0)]) == []


NUMEL, DECAY_END, DECOUPLED = 1000, 700, ((0, 230), (610, 700))  # as a d=1 untied stage's


@pytest.mark.parametrize("impl,name", KERNEL_OPTIMIZERS)
def test_every_kernel_steps_and_predicts_the_decoupled_ranges_at_their_own_lr(impl, name):
    """One optimizer over the whole layout with lr (lr, decoupled lr) equals one optimizer per
    segment at its lr, out of place as 2BW steps; so does the compensation's prediction (Adam:
    with the spike and the nesterov form; SGD: from the momentum): bit for bit (torch's fused
    kernels round a vector tail at a cut differently: 1 ulp)."""
    cfg = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1, sgd_momentum=0.9,
                          decoupled_lr=3e-2)
    rates, pred = (1e-2, 3e-2), (2e-3, 7e-3)
    adam = name == "adam"
    whole = make_optimizer(cfg, NUMEL, DECAY_END, "cpu", impl=impl, keep_grad=adam,
                           decoupled=DECOUPLED)
    parts = [(lo, hi, k, make_optimizer(cfg, hi - lo, hi - lo if wd else 0, "cpu", impl=impl,
                                        keep_grad=adam))
             for lo, hi, wd, k in whole.segments]
    assert [k for *_, k, _ in parts] == [1, 0, 1, 0]
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(NUMEL, generator=gen)
    b = a.clone()
    for _ in range(3):
        g = torch.randn(NUMEL, generator=gen)
        out_a, out_b = torch.empty(NUMEL), torch.empty(NUMEL)
        whole.step(a, g.clone(), out_a, rates)
        for lo, hi, k, opt in parts:
            opt.step(b[lo:hi], g[lo:hi].clone(), out_b[lo:hi], rates[k])
        a, b = out_a, out_b
    tol = dict(rtol=0, atol=0) if impl in ("unfused", "native") else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a, b, **tol)
    for kw in ([{}, {"nesterov": True}, {"spike": g}] if adam else [{}]):
        got, want = torch.empty(NUMEL), torch.empty(NUMEL)
        spike = kw.get("spike")
        src_a, src_b = a.clone(), a.clone()
        whole.predict(src_a, got, pred, nesterov=kw.get("nesterov", False),
                      spike=None if spike is None else (spike, rates))
        for lo, hi, k, opt in parts:
            opt.predict(src_b[lo:hi], want[lo:hi], pred[k], nesterov=kw.get("nesterov", False),
                        spike=None if spike is None else (spike[lo:hi], rates[k]))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert whole.steps == 3


def test_the_native_kernels_fused_prediction_uses_each_ranges_lr():
    """The native step writes the prediction in its own pass (`step(..., predict=)`): with the
    pair of lrs it equals the step followed by predict_chunks."""
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, decoupled_lr=3e-2)
    gen = torch.Generator().manual_seed(4)
    w0, g = torch.randn(NUMEL, generator=gen), torch.randn(NUMEL, generator=gen)
    fused = make_optimizer(cfg, NUMEL, DECAY_END, "cpu", impl="native", keep_grad=True,
                           decoupled=DECOUPLED)
    plain = make_optimizer(cfg, NUMEL, DECAY_END, "cpu", impl="native", keep_grad=True,
                           decoupled=DECOUPLED)
    for opt in (fused, plain):  # one step first: a state to predict from
        opt.step(w0.clone(), g * 0.5, torch.empty(NUMEL), (1e-2, 3e-2))
    a, b, out_a, out_b = w0.clone(), w0.clone(), torch.empty(NUMEL), torch.empty(NUMEL)
    fused.step(a, g, a, (1e-2, 3e-2), predict=(out_a, (2e-3, 7e-3), True, True))
    plain.step(b, g, b, (1e-2, 3e-2))
    plain.predict(b, out_b, (2e-3, 7e-3), nesterov=True, spike=(g, (1e-2, 3e-2)))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out_a, out_b, rtol=1e-6, atol=1e-7)


def _stage(extra, start, end, shards=1):
    cfg, _ = parse("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                   "--vocab-size 128".split() + extra)
    specs = gpt_layer_specs(cfg.model)
    module = StageModule(specs, start, end)
    return VersionedWeights(module, 1, "fp32", "cpu", tied=module.tied, shard_count=shards,
                            split_tied=end - start < len(specs)), cfg


def test_the_embedding_and_output_layer_are_the_decoupled_ranges_of_a_stage():
    vocab = 128 * 32
    tied, _ = _stage([], 0, 4)  # one stage, tied: the word embedding once, first
    assert tied.decoupled == ((0, vocab),)
    untied, _ = _stage(["--untie-embeddings-and-output-weights"], 0, 4)
    (lo0, hi0), (lo1, hi1) = untied.decoupled  # the embedding first, the head last of the split
    assert (lo0, hi0 - lo0, hi1 - lo1) == (0, vocab, vocab) and hi1 <= untied.decay_end
    names = untied.named_tensors(untied.slots[0])
    assert names["layers.3.weight"].data_ptr() == untied.slots[0][lo1:hi1].data_ptr()
    last, _ = _stage(["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"], 2, 4,
                     shards=2)  # the tied copy
    assert last.decoupled == ((0, vocab),) and last.tied_end == vocab
    middle, _ = _stage([], 1, 3)
    assert middle.decoupled == ()
    assert all(p.is_embedding_or_output_parameter == (n == "layers.0.word_embeddings.weight")
               for n, p in tied.modules[0].named_parameters())


def test_decoupled_lr_with_a_deepspeed_scheduler_is_a_one_line_error():
    """The DeepSpeed JSON's scheduler replaces Megatron's schedule, which the decoupled lr
    follows: the two together are refused before any process group starts."""
    from megatron_2bw.config import Config, ConfigError
    from megatron_2bw.config.ds_json import merge_flags_and_ds_config
    cfg = Config().replace(parallel={"pipeline": 1}, model={"num_layers": 2},
                           optimizer={"decoupled_lr": 1e-2})
    ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    with pytest.raises(ConfigError, match=r"^[^\n]*--decoupled-lr follows Megatron's lr "
                                          r"schedule .* drop one of them$"):
        merge_flags_and_ds_config(cfg, ["--decoupled-lr"], ds, world_size=2)
    merge_flags_and_ds_config(cfg, ["--decoupled-lr"], {k: v for k, v in ds.items()
                                                        if k != "scheduler"}, world_size=2)
