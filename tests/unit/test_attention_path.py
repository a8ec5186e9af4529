"""The causal GPT's attention takes scaled_dot_product_attention's fused path (no explicit mask,
is_causal), flash on a GPU; attention dropout stays a function of the tracker's seed; a stage
without dropout is never seeded (issue 16)."""
import pytest
import torch

from megatron_2bw.config import ModelConfig
from megatron_2bw.models import attention as attn_mod
from megatron_2bw.models.bert import bert_layer_specs
from megatron_2bw.models.gpt import gpt_layer_specs
from megatron_2bw.models.stage import LayerSpec, StageModule
from megatron_2bw.models.transformer import TransformerLayer
from megatron_2bw.tensor_parallel import RNGTracker

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                  seq_length=16)


def _record_sdpa(monkeypatch):
    calls, real = [], attn_mod.F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append({"mask": attn_mask, "p": dropout_p, "causal": is_causal, "q": q})
        return real(q, k, v, attn_mask, dropout_p, is_causal, **kw)
    monkeypatch.setattr(attn_mod.F, "scaled_dot_product_attention", sdpa)
    return calls


def test_causal_gpt_attention_uses_the_fused_causal_path(monkeypatch):
    """No materialized mask and is_causal=True: what lets SDPA pick its flash kernel."""
    calls = _record_sdpa(monkeypatch)
    model = StageModule(gpt_layer_specs(CFG), 0, CFG.num_layers + 2)
    model(torch.randint(64, (2, 16))).sum().backward()
    assert len(calls) == CFG.num_layers
    for c in calls:
        assert c["mask"] is None and c["causal"] and c["p"] == 0.0
        assert c["q"].stride(-1) == 1  # flash needs the head dim contiguous


def test_bert_keeps_its_padding_mask(monkeypatch):
    calls = _record_sdpa(monkeypatch)
    model = StageModule(bert_layer_specs(CFG), 0, CFG.num_layers + 2)
    model(torch.randint(64, (2, 16)), torch.zeros(2, 16, dtype=torch.long),
          torch.ones(2, 16, dtype=torch.bool))
    assert calls and all(c["mask"] is not None and not c["causal"] for c in calls)


def test_attention_dropout_is_a_function_of_the_trackers_seed():
    """The tracker is reseeded lazily (its states are made on first use), and the same seed
    gives the same masks, another seed others."""
    cfg = ModelConfig(**{**CFG.__dict__, "attention_dropout": 0.5})
    tracker = RNGTracker(1)
    layer = TransformerLayer(cfg, tracker=tracker).train()
    x = torch.randn(2, 16, 32)

    def out(seed):
        tracker.reseed(seed)
        assert tracker._cpu is None, "reseeding makes no generator state until it is used"
        return layer(x)
    a, b, c = out(5), out(5), out(6)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_only_stages_that_draw_random_numbers_are_seeded():
    def stage(cfg, lo, hi):
        return StageModule(gpt_layer_specs(cfg), lo, hi).draws_random
    assert not stage(CFG, 0, 4)
    dropout = ModelConfig(**{**CFG.__dict__, "hidden_dropout": 0.1})
    assert stage(dropout, 0, 1) and stage(dropout, 1, 3) and not stage(dropout, 3, 4)
    attention = ModelConfig(**{**CFG.__dict__, "attention_dropout": 0.1})
    assert not stage(attention, 0, 1) and stage(attention, 1, 2)
    unknown = [LayerSpec(lambda: torch.nn.Linear(4, 4))]  # a user's layer: may draw, seeded
    assert StageModule(unknown, 0, 1).draws_random


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernel needs a GPU")
def test_flash_kernel_runs_our_attention_on_a_gpu():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    layer = TransformerLayer(ModelConfig(**{**CFG.__dict__, "hidden_size": 128,
                                            "num_attention_heads": 2})).cuda().bfloat16()
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = layer(x)
        flash.sum().backward()
    with sdpa_kernel(SDPBackend.MATH):
        math = layer(x)
    torch.testing.assert_close(flash, math, rtol=2e-2, atol=2e-2)
