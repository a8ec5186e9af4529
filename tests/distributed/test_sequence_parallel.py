"""--sequence-parallel (Megatron's meaning) on real gloo processes: GPT and BERT equal the
single-process reference (tools/verify_equivalence.py, fp32, rtol 1e-5), stage-to-stage messages
carry 1/t of the sequence, a layer keeps what models/flops.py counts, and bad settings are
one-line errors.

The default run keeps (t, d, w) = (2, 2, 1); `-m slow` adds (2, 2, 2) and the other schedules."""
import os
import tempfile

import pytest
import torch

from megatron_2bw.config import ConfigError, ModelConfig
from megatron_2bw.config.build import build_config
from megatron_2bw.models.flops import layer_costs
from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.pretrain import build_parser
from megatron_2bw.schedule import actions as A
from megatron_2bw.testing.verify import parse, run
from megatron_2bw.training.spawn import spawn
from test_flops import _saved_bytes

# init std 0.1 (about 1/sqrt(hidden), as test_equivalence_llama.py explains): at Megatron's 0.02
# Adam turns the tensor ranks' reassociation into 7e-6 here (2.4e-5 on another CPU), at 0.1 4e-7
TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 4 --clip-grad 0.3 --init-method-std 0.1 "
        "--sequence-parallel").split()


class SequenceChunksOnly(PipelineEngine):
    """Fails the run unless every activation sent to the next stage holds s/t positions."""

    def _communicate(self, group, ahead):
        t, s = self.grid.tensor, self.cfg.model.seq_length
        for a in group:
            if a.kind == A.SEND_ACT:
                hidden = self.act_out[a.mb][0]
                assert hidden.shape[1] == s // t, f"sent {tuple(hidden.shape)}, want s/t={s // t}"
        super()._communicate(group, ahead)


def check(model, schedule, t, d, w, engine_class=PipelineEngine):
    cfg, _ = parse(["--model-type", model, "--schedule", schedule, "--tensor-model-parallel-size",
                    str(t), "--pipeline-model-parallel-size", str(d), "--data-parallel-size",
                    str(w), "--global-batch-size", str(8 * w)] + TINY)
    assert cfg.parallel.sequence_parallel
    rep = run(cfg, timeout_minutes=2, engine_class=engine_class)
    assert rep.passed(1e-5), rep
    assert rep.tied_equal and rep.replicas_equal and not rep.problems


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_t2_d2_matches_reference_and_sends_sequence_chunks(model):
    check(model, "2bw", 2, 2, 1, SequenceChunksOnly)


@pytest.mark.slow
@pytest.mark.parametrize("t,d,w", [(2, 2, 1), (2, 2, 2)], ids=["t2d2", "t2d2w2"])
@pytest.mark.parametrize("schedule", ["gpipe", "flush", "2bw"])
@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_full_matrix(model, schedule, t, d, w):
    check(model, schedule, t, d, w)


def _saved_layer_bytes(rank, world_size, outdir):
    from megatron_2bw.models.transformer import TransformerLayer
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.tensor_parallel import RNGTracker, TPGroup
    grid = ProcessGrid(2, 1, 1, rank=rank).init_groups()
    tp = TPGroup.from_grid(grid, sequence_parallel=True)
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
    layer = TransformerLayer(cfg, tp, RNGTracker(1, rank))
    x = torch.randn(4, 32 // 2, 64, requires_grad=True)  # this rank's chunk of the sequence
    out = []
    kept = _saved_bytes(layer, lambda: out.append(layer(x)))
    out[0].sum().backward()
    y = out[0]
    torch.save({"bytes": kept, "shape": tuple(y.shape)},
               os.path.join(outdir, f"{rank}.pt"))


def test_a_layer_keeps_what_the_memory_model_counts():
    """(Without dropout: on CPU, dropout keeps a float mask where CUDA keeps the one-byte mask
    the model counts.)"""
    with tempfile.TemporaryDirectory() as d:
        spawn(_saved_layer_bytes, 2, args=(d,), timeout_minutes=1)
        res = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(2)]
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
    split = layer_costs(cfg, 4, 2, "fp32", sequence_parallel=True)[1]
    whole = layer_costs(cfg, 4, 2, "fp32")[1]
    for r in res:
        assert r["shape"] == (4, 16, 64)
        assert r["bytes"] == pytest.approx(split.act_bytes, rel=0.01)
    assert split.act_bytes < whole.act_bytes and split.output_bytes * 2 == whole.output_bytes


@pytest.mark.parametrize("argv,words", [
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "15"],
     ["--seq-length 15", "divisible by --tensor-model-parallel-size 2"]),
    (["--recompute-activations", "--recompute-granularity", "full", "--recompute-method",
      "uniform", "--recompute-num-layers", "1"], ["--recompute-activations", "selective"]),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     ["--recompute-method", "--recompute-granularity full"]),
])
def test_bad_settings_are_one_line_errors(argv, words):
    args = build_parser("gpt").parse_args(["--mock-data", "--num-attention-heads", "4"] + argv)
    with pytest.raises(ConfigError) as e:
        build_config(args, "gpt", 2)
    msg = str(e.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg, (word, msg)
