"""models/flops.py: parameter counts equal the real modules', the standard formulas hold, and the
activation estimate equals what autograd actually saves."""
import pytest
import torch

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.bert import bert_layer_specs
from megatron_2bw.models.flops import (layer_costs, layer_params, model_flops_per_sample,
                                       named_model, num_parameters, pad_vocab,
                                       standard_parameter_count)
from megatron_2bw.models.gpt import GPTEmbedding, GPTHead, gpt_layer_specs, gpt_loss
from megatron_2bw.models.transformer import TransformerLayer
from megatron_2bw.tensor_parallel import TPGroup


def _tiny(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=128)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("family,specs_fn", [("gpt", gpt_layer_specs), ("bert", bert_layer_specs)])
@pytest.mark.parametrize("untie", [False, True])
@pytest.mark.parametrize("tensor", [1, 2])
def test_layer_params_equal_the_modules(family, specs_fn, untie, tensor):
    cfg = _tiny(family=family, untie_embeddings_and_output_weights=untie, ffn_hidden_size=96)
    tp = TPGroup(None, 0, tensor)
    real = [sum(p.numel() for p in spec.build().parameters()) for spec in specs_fn(cfg, tp)]
    assert [p for p, _ in layer_params(cfg, tensor)] == real
    tied = [t for _, t in layer_params(cfg, tensor)]
    shared = family == "bert" or not untie
    assert tied == ([128 * 32 // tensor, 0, 0, 128 * 32 // tensor] if shared else [0, 0, 0, 0])


def test_num_parameters_counts_a_tied_embedding_once():
    cfg = _tiny()
    model = torch.nn.ModuleList(s.build() for s in gpt_layer_specs(cfg))
    unique = sum(p.numel() for p in model.parameters())
    assert num_parameters(cfg) == unique - 128 * 32  # the two builds hold separate copies
    assert num_parameters(_tiny(untie_embeddings_and_output_weights=True)) == unique


def test_gpt_1_3b_matches_the_standard_formula():
    cfg = named_model("gpt-1.3b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size,
            cfg.seq_length) == (24, 2048, 16, 50304, 2048)
    assert pad_vocab(50257) == 50304
    n, ref = num_parameters(cfg), standard_parameter_count(cfg)
    assert abs(n - ref) / ref < 0.01
    assert 1.30e9 < n < 1.33e9


def test_model_flops_per_sample_is_megatrons_formula():
    for name in ("gpt-1.3b", "gpt-2.7b", "debug"):
        cfg = named_model(name)
        L, h, s, V = cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.vocab_size
        ref = 72.0 * s * L * h * h * (1 + s / (6.0 * h) + V / (12.0 * h * L))
        assert model_flops_per_sample(cfg) == pytest.approx(ref, rel=1e-12)
        assert model_flops_per_sample(cfg, recompute=True) == pytest.approx(ref * 4 / 3, rel=1e-12)
    # the full Config works too (training logs pass it)
    from megatron_2bw.config import Config
    assert model_flops_per_sample(Config(model=_tiny())) == model_flops_per_sample(_tiny())


def test_flops_scale_with_micro_batch_and_tensor_size():
    cfg = _tiny()
    one, four = layer_costs(cfg, 1), layer_costs(cfg, 4)
    assert four[1].fwd_flops == pytest.approx(4 * one[1].fwd_flops)
    assert four[1].bwd_flops == pytest.approx(2 * four[1].fwd_flops)
    assert layer_costs(cfg, 4, tensor=2)[1].fwd_flops == pytest.approx(four[1].fwd_flops / 2)


def _saved_bytes(module, fn):
    """Bytes autograd saves for the backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
            seen[key] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


# architecture variants (config.py's flags) next to the GPT-2 shape
ARCH_SHAPES = {
    "gpt2": {},
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  group_query_attention=True, num_query_groups=2, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
    "llama-biases-partial-rope": dict(position_embedding_type="rope", rotary_percent=0.5,
                                      normalization="RMSNorm", swiglu=True,
                                      group_query_attention=True, num_query_groups=2),
    "gqa-gelu": dict(group_query_attention=True, num_query_groups=1),
    "swiglu-layernorm": dict(swiglu=True),
    "no-bias": dict(add_bias_linear=False, openai_gelu=True),
}


@pytest.mark.parametrize("shape", ARCH_SHAPES)
def test_activation_bytes_equal_what_autograd_saves(shape):
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=512, **ARCH_SHAPES[shape])
    b, s, h = 4, 32, 64
    costs = layer_costs(cfg, b, 1, "fp32")
    torch.manual_seed(0)
    layer, head, emb = TransformerLayer(cfg), GPTHead(cfg), GPTEmbedding(cfg)
    x = torch.randn(b, s, h, requires_grad=True)
    tokens = torch.randint(0, 512, (b, s))
    assert _saved_bytes(layer, lambda: layer(x)) == pytest.approx(costs[1].act_bytes, rel=0.01)
    assert _saved_bytes(head, lambda: gpt_loss(head(x), tokens)) == \
        pytest.approx(costs[-1].act_bytes, rel=0.01)
    assert _saved_bytes(emb, lambda: emb(tokens)) == pytest.approx(costs[0].act_bytes, rel=0.01)
    assert costs[1].input_bytes == b * s * h * 4 == costs[1].output_bytes
    # half precision halves the hidden-sized tensors
    half = layer_costs(cfg, b, 1, "bf16")[1].act_bytes
    assert 0.45 * costs[1].act_bytes < half < 0.55 * costs[1].act_bytes


def test_named_models_and_bad_names():
    assert named_model("debug").hidden_size == 64
    assert named_model("bert-large").family == "bert"
    with pytest.raises(ValueError, match="did you mean gpt-1.3b"):
        named_model("gpt-1.3")
    with pytest.raises(ValueError, match="unknown model family"):
        layer_costs(_tiny(), 1, arch="t5")
