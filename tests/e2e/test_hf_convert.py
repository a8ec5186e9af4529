"""Round trips against HuggingFace's own code, with no download (tiny models built from configs):

- HF -> import -> our model gives HF's logits (fp32, max |diff| <= 1e-5), GPT-2 and Llama shapes;
- a checkpoint trained at (t=2, d=2) reads back as the single-process reference's newest weights,
  and export -> AutoModelForCausalLM.from_pretrained gives our logits, both shapes;
- an imported checkpoint at (t=2, d=2) is what `--load` (with and without --finetune) trains
  from: the first loss equals HF's loss on the same batch;
- everything that cannot be converted exactly is a one-line error naming the reason.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from inprocess import run_main  # noqa: E402
from megatron_2bw.checkpoint.api import CheckpointError  # noqa: E402
from megatron_2bw.checkpoint.convert.hf import export_hf, import_hf, require_hf  # noqa: E402
from megatron_2bw.checkpoint.convert.hf_mapping import ConvertError  # noqa: E402
from megatron_2bw.checkpoint.convert.native import (FullModel, one_process_model, read_checkpoint,
                                                    write_checkpoint)
from megatron_2bw.config.build import build_config  # noqa: E402
from megatron_2bw.models.families import model_parts
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pretrain import build_parser  # noqa: E402
from megatron_2bw.testing.reference import reference_train  # noqa: E402
from megatron_2bw.training.build import batches, mock_batches, mock_dataset
from megatron_2bw.training.loop import train
from megatron_2bw.training.spawn import spawn  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[2]
V = 500  # not a multiple of 128: import pads it


def hf_model(kind: str, **kw):
    """A tiny HF model with every parameter perturbed (non-trivial norms and biases)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        base = dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                    bos_token_id=None, eos_token_id=None)
        config = transformers.GPT2Config(**dict(base, **kw))
        model = transformers.GPT2LMHeadModel(config)
    else:
        base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    rope_theta=5000.0, bos_token_id=None, eos_token_id=None)
        base.update(kw)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, p in model.named_parameters():
            if name.endswith("k_proj.bias"):
                p.zero_()  # our attention keeps no key bias; with RoPE it would matter
    return model.eval()


HF_CASES = {
    "gpt2": ("gpt2", {}),
    "gpt2-untied-erf-gelu": ("gpt2", {"activation_function": "gelu",
                                      "tie_word_embeddings": False}),
    "llama-gqa": ("llama", {}),
    "llama-tied-biases-mha": ("llama", {"num_key_value_heads": 4, "attention_bias": True,
                                        "mlp_bias": True, "tie_word_embeddings": True}),
    "llama-head-dim-8": ("llama", {"head_dim": 8}),  # --kv-channels 8 (hidden / heads = 16)
}


def logits(model, tokens, ours=False):
    with torch.no_grad():
        return model(tokens)[..., :V] if ours else model(tokens).logits


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_import_gives_hf_logits_and_exports_back(case, tmp_path):
    kind, kw = HF_CASES[case]
    hf = hf_model(kind, **kw)
    hf.save_pretrained(tmp_path / "hf")
    full = import_hf(str(tmp_path / "hf"))
    assert full.config.model.vocab_size == 512  # padded as the data pipeline pads
    tokens = torch.randint(0, V, (2, 40))
    want = logits(hf, tokens)
    assert (logits(one_process_model(full), tokens, ours=True) - want).abs().max() <= 1e-5
    export_hf(full, str(tmp_path / "back"), vocab_size=V)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    assert (logits(back, tokens) - want).abs().max() <= 1e-5


# -- a trained checkpoint at (t=2, d=2) --------------------------------------------------------
BASE = ("--mock-data --seq-length 16 --micro-batch-size 2 --global-batch-size 8 "
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --log-interval 1 "
        "--vocab-size 256 --hidden-dropout 0 --attention-dropout 0").split()  # logits compared
SHAPE_FLAGS = {"gpt": "--num-layers 2 --hidden-size 64 --num-attention-heads 4".split(),
               "llama": ["--model", "llama-debug"]}


def make_cfg(argv):
    return build_config(build_parser("gpt").parse_args(BASE + argv), "gpt", 4).config


def _train_worker(rank, world_size, cfg, out):
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    dataset = mock_dataset(cfg)
    losses = train(cfg, grid, "cpu", log=lambda line: None,
                   make_data=lambda start: batches(cfg, dataset, grid.data, grid.dp_rank, start))
    torch.save(losses, f"{out}.{rank}")


def train_4(cfg, out):
    spawn(_train_worker, 4, args=(cfg, out), timeout_minutes=2)
    return torch.load(f"{out}.3")  # a rank of the last stage


@pytest.mark.parametrize("shape,schedule", [("gpt", "2bw"), ("llama", "2bw"),
                                            ("llama", "flush")])
def test_t2_d2_checkpoint_reads_as_newest_weights_and_exports_to_hf_logits(shape, schedule,
                                                                           tmp_path):
    save = str(tmp_path / "ckpt")
    cfg = make_cfg(SHAPE_FLAGS[shape] + ["--pipeline-schedule", schedule, "--train-iters", "3",
                                         "--optimizer", "sgd", "--save", save])
    train_4(cfg, str(tmp_path / "losses"))
    full = read_checkpoint(save)
    specs, loss_fn, _ = model_parts(cfg)
    ref, _, _ = reference_train(cfg, specs, loss_fn, lambda r: mock_batches(cfg, 1, r), 3)
    assert set(full.state) == set(ref)
    for name, value in ref.items():  # the newest version W(3), merged from 4 shards
        torch.testing.assert_close(full.state[name], value, rtol=1e-5, atol=1e-7)
    out = tmp_path / "hf"
    kind = export_hf(full, str(out))
    assert kind == {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[shape]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == kind
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ours = one_process_model(full)(tokens)
        assert (hf(tokens).logits - ours).abs().max() <= 1e-5


@pytest.mark.parametrize("flags,kind", [
    (["--apply-layernorm-1p"], "GPT2LMHeadModel"),
    (["--model", "llama-debug", "--apply-layernorm-1p", "--kv-channels", "8"],
     "LlamaForCausalLM")], ids=["gpt2-1p", "llama-1p-kv8"])
def test_export_of_megatrons_architecture_flags_gives_our_logits(flags, kind, tmp_path):
    """--apply-layernorm-1p: the exported norm weights are gamma = 1 + ours; --kv-channels:
    Llama's head_dim. Every weight perturbed, so a missing +1 or a wrong head size shows."""
    cfg = make_cfg(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                    *flags])
    specs, _, _ = model_parts(cfg)
    from megatron_2bw.testing.reference import build_sequential
    torch.manual_seed(0)
    state = {n: p.detach() + 0.05 * torch.randn_like(p)
             for n, p in build_sequential(cfg, specs).named_parameters()}
    full = FullModel(cfg, state)
    assert export_hf(full, str(tmp_path / "hf")) == kind
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    if kind == "LlamaForCausalLM":
        assert hf.config.head_dim == 8
    tokens = torch.randint(0, 256, (2, 16))
    ours = logits(one_process_model(full), tokens, ours=True)
    assert (logits(hf, tokens) - ours).abs().max() <= 1e-5
    back = import_hf(str(tmp_path / "hf"))  # HF's norms are plain gamma again
    assert back.config.model.kv_channels == cfg.model.kv_channels
    assert (logits(one_process_model(back), tokens, ours=True) - ours).abs().max() <= 1e-5


# -- an imported checkpoint trains -------------------------------------------------------------
def _hf_first_loss(hf, cfg):
    """HF's mean next-token loss over batch 0's microbatches (the mock data)."""
    it = mock_batches(cfg, 1, 0)
    m = cfg.num_microbatches
    total = 0.0
    with torch.no_grad():
        for _ in range(m):
            tokens, labels = next(it)
            out = hf(tokens).logits
            total += torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                       labels.reshape(-1)).item() / m
    return total


@pytest.mark.parametrize("kind,finetune", [("llama", True), ("gpt2", False)])
def test_imported_t2_d2_checkpoint_trains_from_hf_weights(kind, finetune, tmp_path):
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # GPT-2's are 0.1
    hf = hf_model(kind, vocab_size=256, **(no_dropout if kind == "gpt2" else {}))
    hf.save_pretrained(tmp_path / "hf")
    full = import_hf(str(tmp_path / "hf"), tensor=2)
    ckpt = str(tmp_path / "ckpt")
    write_checkpoint(ckpt, full, tensor=2, pipeline=2)
    from megatron_2bw.checkpoint.convert.cli import model_flags
    flags = model_flags(full.config.model) + ["--load", ckpt, "--train-iters", "1"]
    cfg = make_cfg(flags + (["--finetune"] if finetune else []))
    losses = train_4(cfg, str(tmp_path / "losses"))
    assert losses[0] == pytest.approx(_hf_first_loss(hf, cfg), rel=1e-5)


def test_loading_with_other_architecture_flags_names_the_difference(tmp_path):
    hf = hf_model("llama", vocab_size=256)
    hf.save_pretrained(tmp_path / "hf")
    ckpt = str(tmp_path / "ckpt")
    write_checkpoint(ckpt, import_hf(str(tmp_path / "hf"), tensor=2), tensor=2, pipeline=2)
    from megatron_2bw.checkpoint.layout import check_layout
    from megatron_2bw.checkpoint.convert.cli import model_flags
    from megatron_2bw.checkpoint.torch_format import read_torch
    cfg = make_cfg(model_flags(import_hf(str(tmp_path / "hf")).config.model)
                   + ["--normalization", "LayerNorm"])
    grid = type("G", (), {"tensor": 2, "pipeline": 2})()
    with pytest.raises(CheckpointError, match="normalization RMSNorm != LayerNorm"):
        path = os.path.join(ckpt, "iter_0000000", "mp_rank_00_000", "model_optim_rng.pt")
        check_layout(read_torch(path, 0)["layout"], cfg, grid, path, resharding=False)


# -- the command line and its errors -----------------------------------------------------------
def convert(*argv):
    """tools/checkpoint_convert.py's main in process (the README's export command runs as a
    subprocess in tests/e2e/test_generate.py)."""
    from megatron_2bw.checkpoint.convert.cli import main
    return run_main(main, argv)


def test_import_command_prints_flags_that_train(tmp_path):
    hf = hf_model("llama", vocab_size=2000)  # the tokenizer's (the default corpus's: 2000 pieces)
    hf.save_pretrained(tmp_path / "hf")
    import shutil
    from megatron_2bw.data.default_corpus import default_corpus
    shutil.copy(default_corpus().tokenizer_model, tmp_path / "hf" / "tokenizer.model")
    proc = convert("import", "--load", tmp_path / "hf", "--save", tmp_path / "ckpt",
                   "--tensor-model-parallel-size", "2")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert "--position-embedding-type rope" in line and "--swiglu" in line
    assert f"--tokenizer-model {tmp_path / 'ckpt' / 'tokenizer.model'}" in line
    assert os.path.exists(tmp_path / "ckpt" / "tokenizer.model")
    flags = line.split("pretrain_gpt.py ")[1].split(" --seq-length S")[0].split()
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(ROOT / "pretrain_gpt.py"), *flags,
                          "--mock-data", "--seq-length", "16", "--micro-batch-size", "2",
                          "--global-batch-size", "4", "--train-iters", "2", "--finetune"],
                         capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "iteration        2/       2 |" in run.stdout


def _bert_checkpoint(path):
    cfg = make_cfg(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"])
    cfg = cfg.replace(model={"family": "bert"})
    specs, _, _ = model_parts(cfg)
    from megatron_2bw.testing.reference import build_sequential
    state = {n: p.detach() for n, p in build_sequential(cfg, specs).named_parameters()}
    write_checkpoint(path, FullModel(cfg, state), 1, 1)


def _checkpoint_with(path, *flags):
    cfg = make_cfg(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                    *flags])
    specs, _, _ = model_parts(cfg)
    from megatron_2bw.testing.reference import build_sequential
    state = {n: p.detach() for n, p in build_sequential(cfg, specs).named_parameters()}
    write_checkpoint(path, FullModel(cfg, state), 1, 1)


@pytest.mark.parametrize("make,message", [
    (_bert_checkpoint, "BERT checkpoints cannot be exported: Megatron's BERT is pre-LayerNorm "
                       "and its binary head has no HuggingFace counterpart"),
    (lambda p: _checkpoint_with(p, "--normalization", "RMSNorm"),
     "matches neither GPT2LMHeadModel"),
    (lambda p: _checkpoint_with(p, "--model", "llama-debug", "--rotary-percent", "0.5"),
     "--rotary-percent 0.5 cannot be exported: LlamaForCausalLM rotates every channel"),
    (lambda p: _checkpoint_with(p, "--model", "llama-debug", "--qk-layernorm",
                                "--sequence-parallel"),
     "--qk-layernorm cannot be exported: neither GPT2LMHeadModel nor LlamaForCausalLM has a "
     "norm over each query and key head"),
    (lambda p: _checkpoint_with(p, "--kv-channels", "8"),
     "--kv-channels 8 cannot be exported: GPT2LMHeadModel's heads are n_embd / n_head = 16 "
     "channels wide"),
], ids=["bert", "rmsnorm-gpt", "rotary-percent", "qk-layernorm", "gpt2-kv-channels"])
def test_export_refuses_what_no_hf_class_computes(make, message, tmp_path):
    make(str(tmp_path / "ckpt"))
    proc = convert("export", "--load", tmp_path / "ckpt", "--save", tmp_path / "hf")
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not os.path.exists(tmp_path / "hf")


@pytest.mark.parametrize("kind,change,message", [
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}},
     "Llama rope_type 'llama3' cannot be imported"),
    ("llama", {"hidden_act": "gelu"}, "Llama hidden_act 'gelu' cannot be imported"),
    ("llama", {"attention_bias": True}, "attention_bias != mlp_bias cannot be imported"),
    ("gpt2", {"activation_function": "relu"}, "activation_function 'relu' cannot be imported"),
    ("gpt2", {"model_type": "bert"}, "model_type 'bert' cannot be imported"),
])
def test_import_refuses_what_the_model_cannot_compute(kind, change, message, tmp_path):
    import json
    hf_model(kind).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config.update(change)
    path.write_text(json.dumps(config))
    proc = convert("import", "--load", tmp_path / "hf", "--save", tmp_path / "ckpt")
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not os.path.exists(tmp_path / "ckpt")


def test_nonzero_key_bias_with_rope_is_refused(tmp_path):
    hf = hf_model("llama", attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        hf.model.layers[1].self_attn.k_proj.bias.fill_(0.1)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConvertError, match="layer 1 has a non-zero k_proj.bias"):
        import_hf(str(tmp_path / "hf"))


def test_conversion_never_writes_over_existing_output(tmp_path):
    hf_model("gpt2").save_pretrained(tmp_path / "hf")
    assert convert("import", "--load", tmp_path / "hf", "--save", tmp_path / "c").returncode == 0
    again = convert("import", "--load", tmp_path / "hf", "--save", tmp_path / "c")
    assert again.returncode == 2 and "already holds a checkpoint (iteration 0)" in again.stderr
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    proc = convert("export", "--load", tmp_path / "c", "--save", tmp_path / "out")
    assert proc.returncode == 2 and "is not empty: export into a new directory" in proc.stderr
    groups = convert("import", "--load", tmp_path / "hf", "--save", tmp_path / "t3",
                     "--tensor-model-parallel-size", "3")
    assert groups.returncode == 2 and "not divisible by --tensor-model-parallel-size 3" in \
        groups.stderr
    missing = convert("export", "--load", tmp_path / "nothing", "--save", tmp_path / "x")
    assert missing.returncode == 2 and "is not a checkpoint directory" in missing.stderr


def test_missing_hf_extra_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConvertError, match=r"needs the hf extra \(transformers is not installed\)"
                                           r": pip install \.\[hf\]"):
        require_hf()
