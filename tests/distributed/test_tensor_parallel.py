"""Tensor-parallel layers with t=2 equal their t=1 counterparts (forward and every gradient), and
recomputation reproduces gradients exactly with dropout on."""
import os
import tempfile

import pytest
import torch

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.gpt import gpt_layer_specs, make_gpt_loss
from megatron_2bw.models.stage import StageModule
from megatron_2bw.models.transformer import TransformerLayer
from megatron_2bw.tensor_parallel import (ColumnParallelLinear, RNGTracker, RowParallelLinear,
                                          TPGroup, VocabParallelEmbedding, copy_to_tp_region,
                                          gather_from_tp_region, vocab_parallel_cross_entropy)
from megatron_2bw.training.spawn import spawn

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                  seq_length=8)


def _cases():
    """name -> build(tp): the same layer at any tensor size"""
    return {
        "column": lambda tp: ColumnParallelLinear(32, 48, tp, gather_output=True),
        "column-local": lambda tp: ColumnParallelLinear(32, 48, tp),
        "row": lambda tp: RowParallelLinear(48, 32, tp, input_is_parallel=False),
        "transformer": lambda tp: TransformerLayer(CFG, tp, RNGTracker(1, tp.rank)),
    }


def _run(module, x, post=lambda y: y):
    x = x.clone().requires_grad_(True)
    out = post(module(x))
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), x.grad


def _gather(t, tp, dim):
    parts = [torch.empty_like(t) for _ in range(tp.size)]
    torch.distributed.all_gather(parts, t.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


def _worker(rank, world_size, outdir):
    group = torch.distributed.new_group([0, 1])
    tp = TPGroup(group, rank, 2)
    results = {}
    for name, build in _cases().items():
        torch.manual_seed(0)
        ref = build(TPGroup())
        torch.manual_seed(0)
        par = build(tp)
        x = torch.randn(2, 8, 32 if name != "row" else 48, generator=torch.Generator().manual_seed(1))
        ref_out, ref_gx = _run(ref, x)
        post = (lambda y: gather_from_tp_region(y, tp)) if name == "column-local" else \
            (lambda y: y)
        out, gx = _run(par, x, post)
        assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6), name
        assert torch.allclose(gx, ref_gx, rtol=1e-5, atol=1e-6), name
        ref_params = dict(ref.named_parameters())
        for pname, p in par.named_parameters():
            g = p.grad if getattr(p, "partition_dim", None) is None else \
                _gather(p.grad, tp, p.partition_dim)
            assert torch.allclose(g, ref_params[pname].grad, rtol=1e-5, atol=1e-6), (name, pname)
        results[name] = True
    # vocab-parallel embedding + cross entropy against nn.functional on the full vocabulary
    torch.manual_seed(0)
    emb_ref = VocabParallelEmbedding(64, 16)
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(64, 16, tp)
    tokens = torch.randint(64, (3, 5), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(64, (3, 5), generator=torch.Generator().manual_seed(3))
    for m in (emb_ref, emb):
        h = m(tokens)
        logits = copy_to_tp_region(h, m.tp) @ (torch.randn(64, 16, generator=torch.Generator().manual_seed(4))
                      .chunk(m.tp.size)[m.tp.rank]).t()
        vocab_parallel_cross_entropy(logits, labels, m.tp).mean().backward()
        m.loss = float(vocab_parallel_cross_entropy(logits.detach(), labels, m.tp).mean())
    assert abs(emb.loss - emb_ref.loss) < 1e-5
    assert torch.allclose(_gather(emb.weight.grad, tp, 0), emb_ref.weight.grad, rtol=1e-5,
                          atol=1e-7)
    results["vocab"] = True
    torch.save(results, os.path.join(outdir, f"{rank}.pt"))


def test_tensor_parallel_layers_equal_single_process():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, 2, args=(d,), timeout_minutes=1)
        for r in range(2):
            assert all(torch.load(os.path.join(d, f"{r}.pt")).values())


@pytest.mark.parametrize("method,n", [("uniform", 1), ("uniform", 2), ("block", 1)])
def test_recomputation_reproduces_gradients_with_dropout(method, n):
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64,
                      seq_length=8, hidden_dropout=0.2, attention_dropout=0.2)
    tokens = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
    grads, losses = [], []
    for recompute in (None, method):
        model = StageModule(gpt_layer_specs(cfg, seed=5), 0, cfg.num_layers + 2, seed=5,
                            recompute_method=recompute, recompute_num_layers=n)
        torch.manual_seed(123)
        loss = make_gpt_loss()(model(tokens), labels)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    assert losses[0] == losses[1]
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k
    # and dropout is really on: another seed gives another loss
    model = StageModule(gpt_layer_specs(cfg, seed=5), 0, cfg.num_layers + 2, seed=5)
    torch.manual_seed(124)
    assert float(make_gpt_loss()(model(tokens), labels)) != losses[0]


def _saved_bytes(model, fn):
    """Bytes autograd keeps for the backward (unique storages, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_selective_recomputation_gives_the_gradients_of_no_recomputation(family):
    """--recompute-activations (Megatron's selective recomputation of core attention) replays the
    attention dropout mask: same loss and gradients as without recomputation, less kept."""
    from dataclasses import replace

    from megatron_2bw.models.bert import bert_layer_specs, make_bert_loss
    from megatron_2bw.training.build import mock_batches
    from megatron_2bw.config import Config, BatchConfig
    cfg = ModelConfig(family=family, num_layers=2, hidden_size=32, num_attention_heads=4,
                      vocab_size=64, seq_length=16, hidden_dropout=0.2, attention_dropout=0.3)
    inputs, labels = next(mock_batches(Config(model=cfg, batch=BatchConfig(2, 2)), 1, 0))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    specs_fn, loss_fn = (gpt_layer_specs, make_gpt_loss) if family == "gpt" else \
        (bert_layer_specs, make_bert_loss)
    grads, losses, kept = [], [], []
    for granularity in (None, "selective"):
        model = StageModule(specs_fn(replace(cfg, recompute_granularity=granularity), seed=5),
                            0, cfg.num_layers + 2, seed=5)
        assert all(layer.self_attention.selective == (granularity is not None)
                   for layer in list(model.layers.values())[1:-1])
        torch.manual_seed(123)
        out = []
        kept.append(_saved_bytes(model, lambda: out.append(loss_fn()(model(*inputs), labels))))
        out[0].backward()
        losses.append(float(out[0].detach()))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    assert losses[0] == losses[1]
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-6, atol=1e-8, msg=k)
    assert kept[1] < kept[0], "selective recomputation keeps less for the backward"
    torch.manual_seed(124)  # dropout is really on: another seed gives another loss
    assert float(loss_fn()(model(*inputs), labels).detach()) != losses[1]
