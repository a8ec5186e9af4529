"""checkpoint/megatron/mapping.py, the one map between Megatron's names and layouts and ours: it
names every parameter of every architecture the project builds, its whole-tensor and box
translations agree with each other in both directions, and the name sets (megatron-core's
module and sharded keys, legacy names) translate as Megatron's code names them. (The layouts
against megatron-core's own models: tests/distributed/test_ckpt_megatron.py.)"""
import pytest
import torch

from megatron_2bw.checkpoint.dist.shards import flat_range_boxes
from megatron_2bw.checkpoint.megatron import mapping as mp
from megatron_2bw.checkpoint.names import canonical
from megatron_2bw.config.build import build_config
from megatron_2bw.pretrain import build_parser

BASE = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --global-batch-size 4 --vocab-size 128 --train-iters 3").split()
LLAMA = ("--position-embedding-type rope --normalization RMSNorm --swiglu "
         "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights "
         "--ffn-hidden-size 48").split()
SHAPES = {"gpt2": ("gpt", []), "llama": ("gpt", LLAMA + ["--disable-bias-linear"]),
          "llama-bias-qk": ("gpt", LLAMA + ["--qk-layernorm", "--kv-channels", "16",
                                             "--apply-layernorm-1p"]),
          "bert": ("bert", []), "bert-nobinary": ("bert", ["--bert-no-binary-head"])}


def cfg_of(name, extra=(), world=1):
    family, flags = SHAPES[name]
    return build_config(build_parser(family).parse_args(BASE + flags + list(extra)), family,
                        world).config


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_parameter_of_the_model_has_one_link_of_its_shape(name):
    cfg = cfg_of(name)
    shapes, _ = canonical(cfg)
    links = mp.links(cfg.model)
    assert [x.ours for x in links] and len({x.ours for x in links}) == len(links)
    assert {x.ours: tuple(x.ours_shape) for x in links} == {n: tuple(s) for n, s in
                                                            shapes.items()}


def _theirs_state(cfg, gen):
    out = {}
    for link in mp.links(cfg.model):
        out.setdefault(link.theirs, torch.randn(link.shape, generator=gen))
    return out


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_whole_tensors_translate_both_ways_bitwise(name):
    cfg = cfg_of(name)
    gen = torch.Generator().manual_seed(0)
    ours = {x.ours: torch.randn(x.ours_shape, generator=gen) for x in mp.links(cfg.model)}
    theirs = mp.theirs_tensors(cfg.model, ours)
    back = {x.ours: mp.to_ours(x, theirs[x.theirs]) for x in mp.links(cfg.model)}
    assert all(torch.equal(back[k], ours[k]) for k in ours)
    for link in mp.links(cfg.model):
        if link.kind == mp.QV:  # written as zeros, the rest is ours
            assert not mp.key_bias(link, theirs[link.theirs]).any()


def test_the_qkv_bias_is_per_query_group_q_then_k_then_v():
    """[G, P + 1, d] (q_1..q_P, v) <-> [G * (P + 2) * d]: group g's rows q_1..q_P, k, v."""
    cfg = cfg_of("llama-bias-qk")
    link = next(x for x in mp.links(cfg.model) if x.kind == mp.QV)
    G, P1, d = link.ours_shape
    theirs = torch.arange(G * (P1 + 1) * d, dtype=torch.float32)
    ours = mp.to_ours(link, theirs)
    rows = theirs.view(G, P1 + 1, d)
    assert torch.equal(ours[:, :P1 - 1], rows[:, :P1 - 1]) and torch.equal(ours[:, -1], rows[:, -1])
    assert torch.equal(mp.key_bias(link, theirs), rows[:, P1 - 1])


def test_swiglu_fc1_is_gate_then_up():
    cfg = cfg_of("llama")
    link = next(x for x in mp.links(cfg.model) if x.kind == mp.GATED)
    theirs = torch.randn(link.shape)
    ours = mp.to_ours(link, theirs)
    f = link.ours_shape[1]
    assert torch.equal(ours[0], theirs[:f]) and torch.equal(ours[1], theirs[f:])


def _boxes(shape, dim, t):
    """Tensor-parallel shards along `dim` and a distributed optimizer's flat cuts of each."""
    out = []
    for r in range(t):
        offsets, sizes = [0] * len(shape), list(shape)
        if dim is not None:
            sizes[dim] = shape[dim] // t
            offsets[dim] = r * sizes[dim]
        out.append((tuple(offsets), tuple(sizes)))
        n = 1
        for s in sizes:
            n *= s
        for lo, hi in ((1, n - 1), (0, n // 3), (n // 3, n)):
            for o, s in flat_range_boxes(tuple(sizes), lo, hi):
                out.append((tuple(a + b for a, b in zip(o, offsets)), tuple(s)))
    return out


@pytest.mark.parametrize("name", ["llama-bias-qk", "gpt2", "bert"])
def test_boxes_read_and_write_what_the_whole_tensors_hold(name):
    """Any box of ours (a tensor rank's shard, a flat piece of it) read through `pieces` from
    their tensor equals that box of the whole translation, and writing it back through the same
    pieces reproduces their tensor."""
    from megatron_2bw.checkpoint.names import stage_module
    cfg = cfg_of(name, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], world=2)
    dims = {n: getattr(p, "partition_dim", None)
            for n, p in stage_module(cfg, 2, 0, 1, 0).named_parameters()}
    gen = torch.Generator().manual_seed(1)
    theirs = _theirs_state(cfg, gen)
    for link in mp.links(cfg.model):
        if link.kind == mp.QV:  # ours holds no key bias: theirs with zeros there round-trips
            theirs[link.theirs] = mp.to_theirs(link, mp.to_ours(link, theirs[link.theirs]))
    rebuilt = {k: torch.full_like(v, float("nan")) for k, v in theirs.items()}
    for link in mp.links(cfg.model):
        whole = mp.to_ours(link, theirs[link.theirs])
        for offsets, sizes in _boxes(link.ours_shape, dims[link.ours], 2):
            box = torch.empty(sizes)
            for p in mp.pieces(link, offsets, sizes):
                view = p.select(box)
                assert view.is_contiguous() and tuple(view.shape) == tuple(p.sizes)
                view.copy_(mp.box(theirs[link.theirs], p.offsets, p.sizes))
            assert torch.equal(box, mp.box(whole, offsets, sizes)), (link.ours, offsets, sizes)
            for p in mp.pieces(link, offsets, sizes):
                mp.box(rebuilt[link.theirs], p.offsets, p.sizes).copy_(p.select(box))
            for o, s in mp.key_pieces(link, offsets, sizes):
                mp.box(rebuilt[link.theirs], o, s).zero_()
    assert all(torch.equal(rebuilt[k], theirs[k]) for k in theirs)


def test_megatron_core_sharded_keys_stack_layers_under_transformer_engine_names():
    assert mp.dist_key("decoder.layers.3.input_layernorm.weight") == \
        ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", 3)
    assert mp.dist_key("encoder.layers.0.pre_mlp_layernorm.bias") == \
        ("encoder.layers.mlp.linear_fc1.layer_norm_bias", 0)
    assert mp.dist_key("decoder.layers.1.mlp.linear_fc1.weight", stacked=False) == \
        ("decoder.layers.1.mlp.linear_fc1.weight", None)
    assert mp.dist_key("output_layer.weight") == ("output_layer.weight", None)
    assert mp.from_module_name("decoder.layers.2.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.2.pre_mlp_layernorm.weight"
    assert mp.from_module_name("decoder.layers.2.input_layernorm.weight") == \
        "decoder.layers.2.input_layernorm.weight"


LEGACY = {  # Megatron's legacy torch-format keys (flattened) -> megatron-core's
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "language_model.encoder.layers.0.input_layernorm.weight": "L.0.input_layernorm.weight",
    "language_model.encoder.layers.0.input_norm.bias": "L.0.input_layernorm.bias",
    "language_model.encoder.layers.1.self_attention.query_key_value.weight":
        "L.1.self_attention.linear_qkv.weight",
    "language_model.transformer.layers.1.attention.query_key_value.bias":
        "L.1.self_attention.linear_qkv.bias",
    "language_model.encoder.layers.1.self_attention.dense.weight":
        "L.1.self_attention.linear_proj.weight",
    "language_model.encoder.layers.1.post_attention_layernorm.weight":
        "L.1.pre_mlp_layernorm.weight",
    "language_model.encoder.layers.1.post_attention_norm.bias": "L.1.pre_mlp_layernorm.bias",
    "language_model.encoder.layers.1.mlp.dense_h_to_4h.weight": "L.1.mlp.linear_fc1.weight",
    "language_model.encoder.layers.1.mlp.dense_4h_to_h.bias": "L.1.mlp.linear_fc2.bias",
    "language_model.encoder.final_layernorm.weight": "B.final_layernorm.weight",
    "language_model.encoder.final_norm.bias": "B.final_layernorm.bias",
    "language_model.output_layer.weight": "output_layer.weight",
    "language_model.pooler.dense.weight": "pooler.dense.weight",
    "lm_head.dense.bias": "lm_head.dense.bias", "lm_head.layernorm.weight":
        "lm_head.layer_norm.weight", "lm_head.norm.bias": "lm_head.layer_norm.bias",
    "lm_head.bias": "output_layer.bias", "binary_head.weight": "binary_head.weight",
    "word_embeddings_for_head.weight": None,
    "language_model.encoder.layers.0.self_attention.core_attention.scale_mask_softmax": None}


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_legacy_names_map_to_megatron_core_names(family):
    block = mp.block_name(family)
    for legacy, core in LEGACY.items():
        want = None if core is None else core.replace("L.", f"{block}.layers.").replace(
            "B.", f"{block}.")
        assert mp.from_legacy(legacy, family) == want, legacy
    # Megatron-DeepSpeed's layer files: the layer-local names
    assert mp.legacy_layer("self_attention.query_key_value.weight") == \
        "self_attention.linear_qkv.weight"
    assert mp.legacy_layer("mlp.dense_4h_to_h.weight") == "mlp.linear_fc2.weight"


def test_tensor_rank_shards_merge_along_megatrons_split_dims():
    shards = [torch.arange(8.).view(4, 2) + 100 * r for r in range(2)]
    qkv = mp.merge_tp("decoder.layers.0.self_attention.linear_qkv.weight", shards, gated=False)
    assert torch.equal(qkv, torch.cat(shards))
    proj = mp.merge_tp("decoder.layers.0.self_attention.linear_proj.weight", shards, gated=False)
    assert torch.equal(proj, torch.cat(shards, dim=1))
    fc1 = mp.merge_tp("decoder.layers.0.mlp.linear_fc1.weight", shards, gated=True)
    assert torch.equal(fc1, torch.cat([shards[0][:2], shards[1][:2], shards[0][2:],
                                       shards[1][2:]]))
    norm = mp.merge_tp("decoder.layers.0.input_layernorm.weight", shards, gated=False)
    assert norm is shards[0]
