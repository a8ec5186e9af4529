"""The architecture flags (Megatron's names): parsing, flavours, one-line errors, tensor-parallel
layouts, and parameter and FLOP counts for every flavour shape (tiny ones against the built
modules, the 1B/3B/8B Llama shapes against HuggingFace's LlamaForCausalLM built on the meta
device, which costs no memory); test_flops.py checks their activation bytes against autograd."""
import pytest
import torch

from megatron_2bw.config import ConfigError, ModelConfig
from megatron_2bw.config.flags import FlagParser, add_model_args, config_from_args
from megatron_2bw.config.flavours import FLAVOURS, LLAMA
from megatron_2bw.models.flops import layer_costs, layer_params, named_model, num_parameters
from megatron_2bw.models.gpt import gpt_layer_specs
from megatron_2bw.models.norms import RMSNorm
from megatron_2bw.tensor_parallel import TPGroup
from test_flops import ARCH_SHAPES


def cfg_of(argv, world=None):
    p = FlagParser(prog="t")
    add_model_args(p)
    from megatron_2bw.config.flags import add_parallel_args, add_training_args
    add_parallel_args(p)
    add_training_args(p)
    cfg = config_from_args(p.parse_args(argv))
    return cfg


def test_flags_fill_the_model_config_with_megatrons_meanings():
    m = cfg_of("--position-embedding-type rope --rotary-base 500000 --rotary-percent 0.5 "
               "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --group-query-attention "
               "--num-query-groups 2 --disable-bias-linear --hidden-size 96 "
               "--num-attention-heads 6".split()).validate().model
    assert (m.position_embedding_type, m.rotary_base, m.rotary_percent, m.normalization,
            m.layernorm_epsilon, m.swiglu, m.query_groups, m.add_bias_linear) == \
        ("rope", 500000.0, 0.5, "RMSNorm", 1e-6, True, 2, False)
    assert m.kv_channels == 16 and m.rotary_dim == 8
    assert m.ffn_size == int((4 * 96 * 2 / 3) / 64) * 64 == 256  # Megatron's SwiGLU default
    plain = cfg_of([]).model
    assert (plain.position_embedding_type, plain.normalization, plain.swiglu, plain.query_groups,
            plain.add_bias_linear, plain.ffn_size) == ("learned_absolute", "LayerNorm", False, 4,
                                                       True, 256)
    # --num-query-groups alone means nothing (Megatron reads it with --group-query-attention)
    assert cfg_of(["--num-query-groups", "2"]).model.query_groups == 4


def test_llama_flavours_and_flags_override_them():
    m = cfg_of(["--model", "llama-debug"]).model
    assert (m.position_embedding_type, m.normalization, m.swiglu, m.query_groups,
            m.add_bias_linear, m.untie_embeddings_and_output_weights, m.hidden_size) == \
        ("rope", "RMSNorm", True, 2, False, True, 64)
    assert m.vocab_size == 512  # the vocabulary comes from the data / --vocab-size, not the flavour
    over = cfg_of(["--model", "llama-debug", "--normalization", "LayerNorm", "--num-query-groups",
                   "4", "--ffn-hidden-size", "96"]).model
    assert (over.normalization, over.query_groups, over.ffn_size, over.swiglu) == \
        ("LayerNorm", 4, 96, True)
    big = named_model("llama-3.1-8b")
    assert (big.num_layers, big.hidden_size, big.query_groups, big.ffn_size, big.vocab_size,
            big.rotary_base, big.untie_embeddings_and_output_weights) == \
        (32, 4096, 8, 14336, 128256, 500000.0, True)


@pytest.mark.parametrize("argv,t,message", [
    ("--group-query-attention --num-query-groups 2", 4,
     "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4: every tensor rank "
     "holds whole query groups"),
    ("--group-query-attention --num-query-groups 3", 1,
     "--num-query-groups 3 must divide --num-attention-heads 4"),
    ("--position-embedding-type rope --rotary-percent 0", 1, "--rotary-percent must be in (0, 1]"),
    ("--position-embedding-type rope --rotary-percent 0.1", 1,
     "rotates 1 of the 16 channels per head: RoPE needs an even number"),
    ("--norm-epsilon 0", 1, "--norm-epsilon must be > 0"),
    ("--swiglu --openai-gelu", 1, "--openai-gelu and --swiglu exclude each other"),
    ("--swiglu --hidden-size 16", 1, "--swiglu's default ffn size"),
    ("--ffn-hidden-size 90", 4, "the ffn size 90 is not divisible by --tensor-model-parallel-size"),
])
def test_bad_architecture_settings_are_one_line_errors(argv, t, message):
    cfg = cfg_of(argv.split() + ["--tensor-model-parallel-size", str(t)])
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert message in str(e.value) and "\n" not in str(e.value)


def _tiny(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                vocab_size=256)
    base.update(kw)
    return ModelConfig(**base)


SHAPES = ARCH_SHAPES


@pytest.mark.parametrize("tensor", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_counts_equal_the_built_modules(shape, tensor):
    cfg = _tiny(**SHAPES[shape])
    if cfg.query_groups % tensor:
        pytest.skip("groups do not divide")
    real = [sum(p.numel() for p in spec.build().parameters())
            for spec in gpt_layer_specs(cfg, TPGroup(None, 0, tensor))]
    assert [p for p, _ in layer_params(cfg, tensor)] == real


def test_flops_count_three_swiglu_matrices_and_fewer_key_value_heads():
    base = _tiny()
    fwd = layer_costs(base, 1)[1].fwd_flops
    h, f, s = 64, 256, 32
    assert layer_costs(_tiny(swiglu=True, ffn_hidden_size=f), 1)[1].fwd_flops - fwd == \
        pytest.approx(2.0 * s * h * f)  # the extra up (or gate) matrix
    gqa = layer_costs(_tiny(group_query_attention=True, num_query_groups=1), 1)[1].fwd_flops
    assert fwd - gqa == pytest.approx(2.0 * s * h * 2 * (h - h // 4))  # K, V: 1 head, not 4
    rope = _tiny(position_embedding_type="rope")
    assert num_parameters(_tiny()) - num_parameters(rope) == 32 * h  # no position table


def _hf_llama_count(name):
    transformers = pytest.importorskip("transformers")
    m = named_model(name)
    config = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.query_groups,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,billions", [("llama-3.2-1b", 1.236), ("llama-3.2-3b", 3.213),
                                           ("llama-3.1-8b", 8.030)])
def test_big_llama_flavours_count_what_huggingface_builds(name, billions):
    assert num_parameters(named_model(name)) == _hf_llama_count(name)
    assert num_parameters(named_model(name)) / 1e9 == pytest.approx(billions, abs=0.001)


def test_every_llama_flavour_is_listed():
    assert set(LLAMA) <= set(FLAVOURS)


def test_rmsnorm_matches_the_plain_formula_and_its_gradient():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5).double()
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 8, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: norm(x), (x, norm.weight))
    y = x.detach()
    plain = norm.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(norm(y), plain)


def test_planner_plans_llama_shapes_with_whole_query_groups_per_tensor_rank(tmp_path):
    import io
    import json
    from megatron_2bw.planner.cli import run as plan_run
    out = io.StringIO()
    assert plan_run("--model llama-3.1-8b --num-nodes 2 --gpus-per-node 8 --gpu-memory-gb 80 "
                    "--global-batch-size 64 --bf16 --top 50 --json".split(), out) == 0
    data = json.loads(out.getvalue())
    assert {c["tensor"] for c in data["candidates"]} <= {1, 2, 4, 8}  # 8 groups: all divide
    out = io.StringIO()
    assert plan_run("--model llama-debug --num-query-groups 1 --num-gpus 4 --gpus-per-node 4 "
                    "--global-batch-size 16 --top 50 --json".split(), out) == 0
    assert {c["tensor"] for c in json.loads(out.getvalue())["candidates"]} == {1}
    # a measured profile records the architecture: another shape cannot reuse it
    path = str(tmp_path / "p.json")
    shape = "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 8 --vocab-size 64"
    assert plan_run(f"{shape} --profile-out {path} --profile-micro-batches 1".split(),
                    io.StringIO()) == 0
    from megatron_2bw.planner.topology import PlanError
    with pytest.raises(PlanError, match="was measured for normalization LayerNorm, not RMSNorm"):
        plan_run(f"{shape} --normalization RMSNorm --profile {path} --num-gpus 2 "
                 "--global-batch-size 8".split(), io.StringIO())
