"""Tensor-parallel initialization materializes only the local shard, and the shards are bitwise
the single-process matrix: for t in {1, 2, 4}, concatenating every rank's shard gives the t=1
tensor, the generator ends where the full draw leaves it, and no tensor of the full size is ever
allocated."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.bert import bert_layer_specs
from megatron_2bw.models.gpt import gpt_layer_specs
from megatron_2bw.models.stage import StageModule
from megatron_2bw.tensor_parallel import TPGroup, VocabParallelEmbedding
from megatron_2bw.tensor_parallel.initialize import STREAM_CHUNK, normal_shard


class Allocations(TorchDispatchMode):
    """Sizes of every tensor an op creates, and the elements `normal_` draws."""

    def __init__(self):
        super().__init__()
        self.created, self.normal = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("empty", "empty_strided", "zeros", "ones", "full", "clone", "cat"):
            self.created.append(out.numel())
        if name == "normal_":
            self.normal += args[0].numel()
        return out


def full_draw(shape, std, seed):
    torch.manual_seed(seed)
    full = torch.empty(shape)
    torch.nn.init.normal_(full, 0.0, std)  # what every rank did before: the whole matrix
    return full, torch.rand(5)             # and where it leaves the generator


SHAPES = [(64, 32), (48, 7), (96, 3), (4, 20), (32, 33, 5), (1024, 48), (40, 1000)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("chunk", [16, 100, STREAM_CHUNK])
def test_shards_concatenate_to_the_full_draw(shape, chunk):
    for dim in range(len(shape)):
        full, after = full_draw(shape, 0.02, seed=7)
        for t in (1, 2, 4):
            if shape[dim] % t:
                continue
            shards = []
            for rank in range(t):
                torch.manual_seed(7)
                shards.append(normal_shard(shape, 0.02, dim, rank, t, chunk=chunk))
                assert torch.equal(torch.rand(5), after), (dim, t, rank)
            assert torch.equal(torch.cat(shards, dim=dim), full), (shape, dim, t, chunk)


def test_a_shard_allocates_and_draws_only_its_share():
    shape, t, chunk = (4096, 64), 4, 4096
    for dim, draws_bound in ((0, 4096 * 64 // t + chunk), (1, 4096 * 64)):
        for rank in range(t):
            torch.manual_seed(3)
            with Allocations() as seen:
                shard = normal_shard(shape, 0.02, dim, rank, t, chunk=chunk)
            assert shard.numel() == 4096 * 64 // t
            assert max(seen.created) <= max(shard.numel(), chunk + 16) < 4096 * 64
            # a row shard Box-Muller-transforms its rows only (the rest is skipped by drawing
            # uniforms); a column shard's elements are spread over the whole stream
            assert seen.normal <= draws_bound, (dim, rank, seen.normal)


def test_the_vocab_embedding_never_allocates_the_full_matrix():
    vocab, hidden, t = 8192, 256, 4  # 2M elements: larger than one stream chunk
    torch.manual_seed(0)
    ref = VocabParallelEmbedding(vocab, hidden).weight.detach()
    for rank in range(t):
        torch.manual_seed(0)
        with Allocations() as seen:
            shard = VocabParallelEmbedding(vocab, hidden, TPGroup(None, rank, t)).weight
        assert max(seen.created) < vocab * hidden
        assert torch.equal(shard.detach(), ref.chunk(t)[rank])


def _params(specs_fn, cfg, t, rank):
    tp = TPGroup(None, rank, t)
    model = StageModule(specs_fn(cfg, tp, seed=11), 0, cfg.num_layers + 2, seed=11)
    return {n: (p.detach(), getattr(p, "partition_dim", None)) for n, p in model.named_parameters()}


@pytest.mark.parametrize("specs_fn", [gpt_layer_specs, bert_layer_specs], ids=["gpt", "bert"])
def test_a_sharded_model_is_the_single_process_model(specs_fn):
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                      seq_length=16, family="gpt" if specs_fn is gpt_layer_specs else "bert")
    ref = _params(specs_fn, cfg, 1, 0)
    for t in (2, 4):
        ranks = [_params(specs_fn, cfg, t, r) for r in range(t)]
        assert set(ranks[0]) == set(ref)
        for name, (value, _) in ref.items():
            dim = ranks[0][name][1]
            parts = [r[name][0] for r in ranks]
            merged = parts[0] if dim is None else torch.cat(parts, dim=dim)
            assert torch.equal(merged, value), (t, name)
