"""tools/generate.py and the README's 'Finetuning and serving elsewhere' commands.

The README block runs as a user types it (the main job with --save, then generate.py, then the
export) in a fresh directory: a few iterations in the default suite, as written (200) in the
slow one. generate.py prints text from the checkpoint; its greedy tokens equal HuggingFace's
`generate(do_sample=False)` on the exported model, and the exported tokenizer gives the ids the
run trained with. Top-p sampling draws only from the nucleus and is reproducible by seed.
"""
import os

import pytest
import torch

from inprocess import run_main
from megatron_2bw.generate import generate, next_token
from test_readme_commands import ROOT, readme_block, run

SECTION = "Finetuning and serving elsewhere (HuggingFace)"
os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"  # nothing downloads


def _prepare(tmp_path_factory, iterations):
    work = tmp_path_factory.mktemp("serve")
    (work / "tools").symlink_to(ROOT / "tools")
    (work / "pretrain_gpt.py").symlink_to(ROOT / "pretrain_gpt.py")
    train, sample, export = readme_block(SECTION)
    assert train[0] == "torchrun" and "--save" in train
    assert sample[:2] == ["python", "tools/generate.py"]
    assert export[:3] == ["python", "tools/checkpoint_convert.py", "export"]
    run(train + iterations, work, timeout=300)
    return work, sample, export


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return _prepare(tmp_path_factory, ["--train-iters", "6", "--log-interval", "3"])


def _sample_and_export(work, sample, export):
    proc = run(sample, work, timeout=120)
    prompt = sample[sample.index("--prompt") + 1]
    text = proc.stdout.strip()
    assert text.startswith(prompt) and len(text) > len(prompt) + 5, proc.stdout
    run(export, work, timeout=120)
    out = work / export[export.index("--save") + 1]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.model",
                                       "tokenizer_config.json"]
    return text, out


def test_readme_generate_prints_text_and_export_writes_a_hf_directory(served):
    _sample_and_export(*served)


@pytest.mark.slow
def test_readme_serving_commands_as_written(tmp_path_factory):
    _sample_and_export(*_prepare(tmp_path_factory, []))


def test_greedy_tokens_equal_hf_generate_on_the_exported_model(served):
    transformers = pytest.importorskip("transformers")
    from megatron_2bw.checkpoint.convert.native import one_process_model, read_checkpoint
    from megatron_2bw.checkpoint.convert.tokenizers import recorded_tokenizer
    work, sample, export = served
    ckpt = work / sample[sample.index("--load") + 1]
    out = work / export[export.index("--save") + 1]
    if not out.exists():
        run(export, work, timeout=120)
    tokenizer = recorded_tokenizer(str(ckpt))
    prompt = tokenizer.tokenize("The for statement")
    model = one_process_model(read_checkpoint(str(ckpt)))
    ours = generate(model, prompt, 24, eod=tokenizer.eod, vocab_limit=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                             eos_token_id=tokenizer.eod, pad_token_id=tokenizer.eod)
    assert theirs[0].tolist() == prompt + ours
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer("The for statement")["input_ids"] == prompt


def test_top_p_draws_only_from_the_nucleus_and_follows_the_seed():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    g = torch.Generator().manual_seed(0)
    draws = [next_token(logits, False, 0.6, 1.0, g) for _ in range(400)]
    assert set(draws) == {0, 1}
    assert 0.55 < draws.count(0) / 400 < 0.7  # 0.5 / 0.8 = 0.625
    assert {next_token(logits, False, 0.4, 1.0, g) for _ in range(50)} == {0}
    assert next_token(logits, True, 1.0, 1.0, None) == 0
    model = lambda x: torch.randn(1, x.shape[1], 7, generator=torch.Generator()  # noqa: E731
                                  .manual_seed(int(x.sum())))
    a = generate(model, [1, 2], 10, greedy=False, top_p=0.9, seed=5)
    assert a == generate(model, [1, 2], 10, greedy=False, top_p=0.9, seed=5)
    assert a != generate(model, [1, 2], 10, greedy=False, top_p=0.9, seed=6)


def gen(*argv):
    """tools/generate.py's main in process (the README command itself runs as a subprocess in
    test_readme_generate_prints_text_and_export_writes_a_hf_directory)."""
    from megatron_2bw.generate import main
    return run_main(main, argv)


@pytest.mark.parametrize("argv,message", [
    (["--greedy", "--top-p", "0.9"], "--greedy and --top-p exclude each other"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
])
def test_bad_generate_flags_are_one_line_errors(argv, message, tmp_path):
    proc = gen("--load", tmp_path, *argv)
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_generate_names_a_missing_checkpoint_and_reads_ids_without_a_tokenizer(tmp_path):
    proc = gen("--load", tmp_path / "nowhere", "--prompt", "x")
    assert proc.returncode == 2 and "is not a checkpoint directory: fix the path" in proc.stderr
    from megatron_2bw.checkpoint.convert.native import FullModel, write_checkpoint
    from megatron_2bw.testing.verify import parse
    from megatron_2bw.testing.reference import build_sequential
    from megatron_2bw.models.families import model_parts
    cfg, _ = parse(["--model", "llama-debug", "--vocab-size", "64"])
    specs, _, _ = model_parts(cfg)
    state = {n: p.detach() for n, p in build_sequential(cfg, specs).named_parameters()}
    write_checkpoint(str(tmp_path / "mock"), FullModel(cfg, state), 1, 2)
    ids = gen("--load", tmp_path / "mock", "--prompt", "3 5 7", "--max-new-tokens", "4")
    assert ids.returncode == 0, ids.stderr
    out = [int(x) for x in ids.stdout.split()]
    assert out[:3] == [3, 5, 7] and len(out) == 7 and max(out) < 64
    empty = gen("--load", tmp_path / "mock")
    assert empty.returncode == 2 and "--prompt is empty" in empty.stderr
