"""Megatron's model flags of issue 34 (--kv-channels, --apply-layernorm-1p, --qk-layernorm) on real
gloo processes: the pipelined, tensor-parallel run equals the single-process reference
(testing/verify.py, fp32, rtol 1e-5), so their gradients (the q/k norms' summed over the tensor
ranks) and their weight decay are right; --log-params-norm logs the norm of every weight, each
counted once."""
import pytest
import torch

from megatron_2bw.config.build import build_config
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.faults import FaultHooks
from megatron_2bw.pretrain import build_parser
from megatron_2bw.testing.verify import parse, run
from megatron_2bw.training.build import batches, mock_dataset
from megatron_2bw.training.loop import train
from megatron_2bw.training.observe.logger import parse_line
from megatron_2bw.training.spawn import spawn

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --train-iters 3 --global-batch-size 8 --weight-decay 0.1 "
         "--kv-channels 16 --apply-layernorm-1p --qk-layernorm --normalization RMSNorm "
         "--position-embedding-type rope --swiglu --lr 1e-2").split()


@pytest.mark.parametrize("t,d,extra", [
    (2, 2, ["--sequence-parallel"]),
    pytest.param(1, 2, [], marks=pytest.mark.slow)], ids=["t2d2-sp", "t1d2"])
def test_megatron_model_flags_match_the_reference(t, d, extra):
    cfg, _ = parse(["--schedule", "2bw", "--tensor-model-parallel-size", str(t),
                    "--pipeline-model-parallel-size", str(d)] + FLAGS + extra)
    m = cfg.model
    assert m.kv_channels == 16 and m.apply_layernorm_1p and m.qk_layernorm
    rep = run(cfg, timeout_minutes=2)
    assert rep.passed(1e-5), rep
    assert rep.tied_equal and rep.replicas_equal and not rep.problems


class KeepEngine(FaultHooks):
    def on_engine(self, engine):
        self.engine = engine


def _params_norm_worker(rank, world_size, cfg, out):
    hooks = KeepEngine()
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    dataset = mock_dataset(cfg)
    lines = []
    train(cfg, grid, "cpu", log=lines.append, hooks=hooks,
          make_data=lambda start: batches(cfg, dataset, grid.data, grid.dp_rank, start))
    w = hooks.engine.weights  # a stage after the first holds a copy of the tied embedding
    copies = {n for n, o in zip(w.names, w.offsets) if o < w.tied_end} \
        if not grid.is_first_stage else set()
    squares = {name: float(t.double().pow(2).sum())
               for name, t in hooks.engine.fp32_state().items() if name not in copies}
    logged = [f for _, f in filter(None, map(parse_line, lines))]
    torch.save((squares, logged), f"{out}.{rank}")


@pytest.mark.parametrize("extra", [
    [], pytest.param(["--use-distributed-optimizer", "--data-parallel-size", "2",
                      "--pipeline-model-parallel-size", "1"], marks=pytest.mark.slow)],
    ids=["d2-tied", "w2-sharded"])
def test_log_params_norm_is_the_norm_of_every_weight_once(tmp_path, extra):
    argv = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 "
            "--seq-length 16 --micro-batch-size 2 --global-batch-size 8 --train-iters 2 "
            "--pipeline-model-parallel-size 2 --log-params-norm --lr 1e-2 "
            "--log-interval 1").split() + extra
    cfg = build_config(build_parser("gpt").parse_args(argv), "gpt", 2).config
    out = str(tmp_path / "r")
    spawn(_params_norm_worker, 2, args=(cfg, out), timeout_minutes=1)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    union = {}
    for squares, _ in ranks:
        union.update(squares)  # replicas (w2) hold the same names: counted once
    logged = [f for _, lines in ranks for f in lines if "params norm" in f]
    assert len(logged) == 2, "the reporting rank logs it at both iterations"
    assert logged[-1]["params norm"] == pytest.approx(sum(union.values()) ** 0.5, rel=1e-3)


def test_no_load_rng_keeps_this_processes_random_state(tmp_path):
    from megatron_2bw.checkpoint.api import load_checkpoint, save_checkpoint
    from megatron_2bw.training.build import mock_batches
    from test_ckpt_async import _one_rank
    engine, cfg, grid = _one_rank(["--save", str(tmp_path), "--no-load-rng"])
    assert cfg.train.load_rng is False
    engine.train_batch(mock_batches(cfg, 1, 0))
    torch.manual_seed(1234)
    save_checkpoint(str(tmp_path), engine, cfg, grid)
    saved = torch.get_rng_state()
    for load_rng in (False, True):
        torch.manual_seed(99)
        ours = torch.get_rng_state()
        fresh, _, _ = _one_rank()
        torch.set_rng_state(ours)
        assert load_checkpoint(str(tmp_path), fresh, cfg, grid, load_rng=load_rng) == 1
        assert torch.equal(torch.get_rng_state(), saved if load_rng else ours), load_rng


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(tmp_path, capsys):
    from megatron_2bw.checkpoint.api import save_checkpoint
    from megatron_2bw.pretrain import parse
    from megatron_2bw.training.build import mock_batches
    from test_ckpt_async import _one_rank
    engine, cfg, grid = _one_rank(["--save", str(tmp_path), "--kv-channels", "8"])
    engine.train_batch(mock_batches(cfg, 1, 0))
    save_checkpoint(str(tmp_path), engine, cfg, grid)
    argv = ["--mock-data", "--load", str(tmp_path), "--train-iters", "20", "--micro-batch-size",
            "2", "--global-batch-size", "4", "--use-checkpoint-args", "--num-layers", "4",
            "--hidden-size", "64"]
    got = parse("gpt", argv).cfg.model
    assert (got.num_layers, got.hidden_size, got.num_attention_heads, got.kv_channels,
            got.seq_length) == (2, 32, 2, 8, 16)
    out = capsys.readouterr().out
    assert (f"megatron-2bw: --use-checkpoint-args: the model's settings from {tmp_path} "
            "iteration 1: num_layers 2, hidden_size 32, num_attention_heads 2, seq_length 16"
            in out), out
    with pytest.raises(SystemExit):
        parse("gpt", ["--mock-data", "--use-checkpoint-args"])
    assert "--use-checkpoint-args reads the model's settings from --load DIR" in \
        capsys.readouterr().err
