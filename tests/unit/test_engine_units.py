"""Engine building blocks without processes: flat optimizers equal torch.optim, versioned weights
switch versions without copying, the p2p handshake round-trips."""
import copy

import pytest
import torch

from megatron_2bw.config import ModelConfig, OptimizerConfig
from megatron_2bw.models.gpt import gpt_layer_specs, gpt_partition
from megatron_2bw.models.stage import StageModule
from megatron_2bw.optim.loss_scale import DynamicLossScaler
from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.optim.optimizer import make_optimizer, torch_reference_optimizer
from megatron_2bw.parallel.p2p import decode_meta, encode_meta
from megatron_2bw.pipeline.weights import VersionedWeights


def _model():
    return StageModule(gpt_layer_specs(ModelConfig(num_layers=2, hidden_size=32,
                                                   num_attention_heads=4, vocab_size=64,
                                                   seq_length=8)), 0, 4)


def stepped(name, steps=4, keep_grad=False):
    """A flat optimizer and torch.optim after the same `steps` random steps: (versioned weights,
    flat optimizer (`keep_grad`: keeping its latest gradient), torch model (each .grad the last
    step's), torch optimizer, the last flat gradient)."""
    cfg = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1)
    ref = _model()
    mine = copy.deepcopy(ref)
    w = VersionedWeights(mine, 1, "fp32", "cpu", tied=mine.tied)
    opt = make_optimizer(cfg, w.numel, w.decay_end, "cpu", keep_grad=keep_grad)
    ref_opt = torch_reference_optimizer(cfg, list(ref.named_parameters()))
    gen = torch.Generator().manual_seed(0)
    flat_grad = None
    for _ in range(steps):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in ref.named_parameters()}
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        ref_opt.step()
        flat_grad = torch.cat([grads[n].reshape(-1) for n in w.names])
        opt.step(w.slots[0], flat_grad, w.slots[0], cfg.lr)
    return w, opt, ref, ref_opt, flat_grad


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_flat_optimizer_matches_torch(name):
    w, _, ref, _, _ = stepped(name)
    mine_named = w.named_tensors(w.slots[0])
    for n, p in ref.named_parameters():
        torch.testing.assert_close(mine_named[n], p.detach(), rtol=1e-6, atol=1e-7)


def test_out_of_place_step_leaves_source_version_untouched():
    cfg = OptimizerConfig(name="adam", lr=1e-2)
    m = _model()
    w = VersionedWeights(m, 2, "fp32", "cpu", tied=m.tied)
    before = w.slots[1].clone()
    opt = make_optimizer(cfg, w.numel, w.decay_end, "cpu")
    opt.step(w.slots[1], torch.ones(w.numel), w.slots[0], cfg.lr)
    assert torch.equal(w.slots[1], before)
    assert not torch.equal(w.slots[0], before)


def test_versions_are_views_switched_without_copies():
    m = _model()
    w = VersionedWeights(m, 2, "fp32", "cpu", tied=m.tied)
    a, b = w.modules
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    base = [s.untyped_storage().data_ptr() for s in w.slots]
    for n in pa:
        assert pa[n].untyped_storage().data_ptr() == base[0]
        assert pb[n].untyped_storage().data_ptr() == base[1]
        assert pa[n].grad.untyped_storage().data_ptr() == w.grads[0].untyped_storage().data_ptr()
    # tied embedding and output layer are one parameter inside a stage, first in the layout
    assert a.layers["0"].word_embeddings.weight is a.layers["3"].weight
    assert w.names[0] == "layers.0.word_embeddings.weight" and w.tied_end == 64 * 32
    # a forward on version 1 uses version 1's numbers
    tokens = torch.randint(64, (2, 8))
    w.slots[1].mul_(0.5)
    assert not torch.allclose(a(tokens), b(tokens))


def test_bf16_weights_keep_fp32_master_and_fold_grads():
    m = _model()
    w = VersionedWeights(m, 2, "bf16", "cpu", tied=m.tied, grad_accumulation="buffer")
    assert w.master.dtype == torch.float32 and w.slots[0].dtype == torch.bfloat16
    w.model_grad.fill_(1.0)
    w.fold_model_grad(1)
    assert float(w.grads[1][:w.numel].sum()) == w.numel and float(w.model_grad.abs().sum()) == 0


def test_gpt_partition_puts_embedding_first_and_head_last():
    cfg = ModelConfig(num_layers=5)
    assert gpt_partition(cfg, 2) == [0, 4, 7]
    assert gpt_partition(cfg, 1) == [0, 7]
    b = gpt_partition(cfg, 4)
    assert b[0] == 0 and b[-1] == 7 and all(x < y for x, y in zip(b, b[1:]))


def test_meta_roundtrip():
    ts = (torch.zeros(2, 3, 4, requires_grad=True), torch.zeros(5, dtype=torch.int64))
    meta = decode_meta(encode_meta(ts, "cpu"))
    assert meta == [(torch.Size([2, 3, 4]), torch.float32, True),
                    (torch.Size([5]), torch.int64, False)]


def test_lr_schedule_warmup_then_cosine():
    lr = LRSchedule(OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2,
                                    lr_decay_style="cosine"), train_iters=10)
    assert lr(0) == 0.5 and lr(1) == 1.0
    assert lr(9) == pytest.approx(0.1)
    assert all(lr(i) >= lr(i + 1) for i in range(1, 9))


def test_dynamic_loss_scaler():
    s = DynamicLossScaler(1024.0, 1.0, window=2, hysteresis=2)
    s.update(True)
    assert s.scale == 1024.0  # hysteresis: first overflow tolerated
    s.update(True)
    assert s.scale == 512.0
    s.update(False)
    s.update(False)
    assert s.scale == 1024.0


# ---- the engine validates the schedule it is about to run ------------------------------------------


def _one_stage_engine(schedule):
    from megatron_2bw.config import BatchConfig, Config, TrainConfig
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine, mock_batches
    cfg = Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   vocab_size=64, seq_length=8),
                 batch=BatchConfig(micro_batch_size=2, global_batch_size=4),
                 train=TrainConfig(train_iters=3), schedule=schedule).validate(1)
    engine = build_engine(cfg, ProcessGrid(1, 1, 1, rank=0), "cpu")  # groups of one: no processes
    return engine, mock_batches(cfg, 1, 0)


class _Counting:
    def __init__(self, it):
        self.it, self.taken = it, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.taken += 1
        return next(self.it)


def test_engine_refuses_a_hand_broken_table_before_running_anything():
    from megatron_2bw.schedule import actions as A
    from megatron_2bw.schedule.tables import make_schedule
    from megatron_2bw.schedule.simulate import ScheduleError
    engine, data = _one_stage_engine("flush")
    good = make_schedule("flush", 1, 2)
    table = good.table()  # F0 B0 F1 B1 R0 N0 S0 -> F0 B0 F1 R0 N0 S0 B1
    table[0].remove(A.B(1, 0))
    table[0].append(A.B(1, 0))
    engine.schedule = good.with_table(table)
    before = engine.weights.slots[0].clone()
    feed = _Counting(data)
    with pytest.raises(ScheduleError, match=r"^Schedule\('flush'.*custom table\) is not a valid "
                                            r"schedule: stage 0 step 3 \(0R0\): reduction of "
                                            r"batch 0 before all its backwards \(1 of 2 done\)$"):
        engine.train_batch(feed)
    assert feed.taken == 0 and engine.iteration == 0
    assert torch.equal(engine.weights.slots[0], before)


@pytest.mark.parametrize("schedule", ["2bw", "gpipe"])
def test_engine_runs_validated_windows_and_asks_the_kind_for_slots(schedule):
    engine, data = _one_stage_engine(schedule)
    assert engine.weights.num_slots == engine.kind.num_slots == {"2bw": 2}.get(schedule, 1)
    for t in range(3):
        engine.train_batch(data)
        assert engine.schedule.verdict is True and engine.iteration == t + 1
    assert engine.module is engine.weights.modules[engine.kind.newest_slot(3)]


def test_the_engine_takes_an_lr_schedule_and_shows_its_public_surface():
    from megatron_2bw.config import BatchConfig, Config, TrainConfig
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine, mock_batches
    cfg = Config(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   vocab_size=64, seq_length=8),
                 batch=BatchConfig(micro_batch_size=2, global_batch_size=4),
                 train=TrainConfig(train_iters=3), schedule="flush").validate(1)
    engine = build_engine(cfg, ProcessGrid(1, 1, 1, rank=0), "cpu",
                          lr_schedule=lambda t: 0.25 * (t + 1))
    data = mock_batches(cfg, 1, 0)
    assert engine.lr == 0.25 and engine.lr_schedule(3) == 1.0
    for t in range(2):
        engine.train_batch(data)
        assert engine.lr == 0.25 * (t + 2)
    engine.optimizer.load_state_dict(engine.optimizer.state_dict())
    default = build_engine(cfg, ProcessGrid(1, 1, 1, rank=0), "cpu")
    assert default.lr == LRSchedule(cfg.optimizer, cfg.train.train_iters)(0)
    frozen = build_engine(cfg, ProcessGrid(1, 1, 1, rank=0), "cpu", lr_schedule=lambda t: 0.0)
    before = frozen.fp32_state()
    frozen.train_batch(mock_batches(cfg, 1, 0))  # the step uses the schedule's lr: nothing moves
    assert all(torch.equal(before[k], v) for k, v in frozen.fp32_state().items())
    default.train_batch(mock_batches(cfg, 1, 0))
    assert not all(torch.equal(before[k], v) for k, v in default.fp32_state().items())
    with pytest.raises(ValueError, match="data-parallel size 2 differs from the grid's 1"):
        build_engine(cfg.replace(**{"parallel.data": 2}), ProcessGrid(1, 1, 1, rank=0), "cpu")
