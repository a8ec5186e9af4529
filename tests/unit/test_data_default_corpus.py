"""The embedded default corpus (Python's help topics): built once per cache, safely by concurrent
processes, no download; its unigram entropy; and the acceptance run: the README's tiny GPT
trained on it ends below that entropy."""
import argparse
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_2bw.data.build import build_gpt_train_data, build_pretrain_data
from megatron_2bw.data.default_corpus import (DEFAULT_VOCAB_SIZE, default_corpus,
                                              default_corpus_unigram_entropy, unigram_entropy)
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.flags import add_data_args
from megatron_2bw.data.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset
from megatron_2bw.data.tokenizer import GPTSentencePieceTokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_2BW_CACHE", str(tmp_path))
    return tmp_path


def digest(root):
    c = default_corpus(root)
    files = sorted(p for p in Path(c.directory).iterdir())
    return str(c.directory), {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in files}


def test_local_rank_0_builds_the_others_wait(tmp_path, monkeypatch):
    import threading
    import time
    from megatron_2bw.data import default_corpus as dc
    calls, real_build = [], dc._build

    def slow_build(d, vocab_size):
        calls.append(d)
        time.sleep(0.3)  # the waiters arrive while local rank 0 builds
        real_build(d, vocab_size)
    monkeypatch.setattr(dc, "_build", slow_build)
    out = []
    threads = [threading.Thread(target=lambda b=b: out.append(dc.default_corpus(tmp_path,
                                                                                builder=b)))
               for b in (False, True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(out) == 3 and len(set(out)) == 1
    with pytest.raises(DataError, match="not built after 0.1 s") as e:
        dc.default_corpus(tmp_path / "other", builder=False, timeout_s=0.1)
    assert "\n" not in str(e.value)
    assert MMapIndexedDataset(out[0].document_prefix).num_tokens > 0


def test_unwritable_cache_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(DataError) as e:
        default_corpus(blocker / "cache")
    assert "MEGATRON_2BW_CACHE" in str(e.value) and "\n" not in str(e.value)


def test_corpus_content_and_entropy(cache):
    c = default_corpus()
    assert Path(c.directory).is_relative_to(cache)
    tok = GPTSentencePieceTokenizer(c.tokenizer_model)
    assert tok.vocab_size == DEFAULT_VOCAB_SIZE
    docs = MMapIndexedDataset(c.document_prefix)
    assert len(docs) > 50 and docs.num_tokens > 50_000
    assert all(docs[i][-1] == tok.eod for i in range(len(docs)))
    text = tok.detokenize(docs[0].tolist())
    assert "statement" in text or "expression" in text
    h = default_corpus_unigram_entropy()
    assert 4.0 < h < math.log(DEFAULT_VOCAB_SIZE)


def test_unigram_entropy_exact(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "u.bin"), np.uint16)
    b.add_document([0, 0, 1, 1, 2, 2, 2, 2], [8])
    b.finalize(str(tmp_path / "u.idx"))
    p = np.array([0.25, 0.25, 0.5])
    assert unigram_entropy(str(tmp_path / "u")) == pytest.approx(float(-(p * np.log(p)).sum()))


def test_no_data_flags_fall_back_to_the_default_corpus(cache):
    args = argparse.Namespace(seq_length=32, seed=1234, train_iters=10, global_batch_size=32,
                              data_path=None, mock_data=False, tokenizer_type=None,
                              tokenizer_model=None, split="969, 30, 1",
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1)
    data = build_gpt_train_data(args)
    assert data.vocab_size == 2048 and len(data.dataset) >= 320
    sample = data.dataset[0]
    assert sample.shape == (33,) and sample.dtype == torch.int64 and int(sample.max()) < 2000
    assert len(data.tokenizer.detokenize(sample.tolist()).split()) > 5
    assert not build_gpt_train_data(args).dataset.built_indices


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_flags_to_train_and_valid_data(cache, family):
    from megatron_2bw.config.flags import add_model_args, add_parallel_args, add_training_args
    p = argparse.ArgumentParser()
    for add in (add_model_args, add_parallel_args, add_training_args):
        add(p)
    add_data_args(p, family)
    args = p.parse_args(["--seq-length", "64", "--train-iters", "4", "--global-batch-size", "8"])
    assert args.data_path is None and args.split == "969, 30, 1" and not args.mock_data
    assert hasattr(args, "mask_prob") == (family == "bert")
    data = build_pretrain_data(args, family, valid_samples=16)
    assert data.vocab_size == 2048 and len(data.train) >= 32 and len(data.valid) >= 16
    t, v = data.train[0], data.valid[0]
    if family == "gpt":
        assert t.shape == v.shape == (65,)
    else:
        assert t["tokens"].shape == v["tokens"].shape == (64,)
        assert t["tokens"][0] == v["tokens"][0] == data.tokenizer.cls
    mock = build_pretrain_data(p.parse_args(["--mock-data", "--vocab-size", "128"]), family,
                               valid_samples=8)
    assert mock.vocab_size == 128 and mock.tokenizer is None and mock.valid is not None
    assert build_pretrain_data(args, family).valid is None


def readme_run() -> list[str]:
    """The flags of the README's main job (which trains on the default corpus)."""
    from test_cli import readme_main_job
    argv = readme_main_job()
    script = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))
    return argv[script + 1:]


def _train_on_default_corpus(rank, world_size, argv, out):
    from megatron_2bw.config.flags import add_model_args, add_parallel_args, add_training_args
    from megatron_2bw.config.build import build_config
    from megatron_2bw.data.build import pretrain_tokenizer
    from megatron_2bw.data.flags import add_data_args
    from megatron_2bw.data.mock import GPTBatches
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine
    p = argparse.ArgumentParser()
    for add in (add_model_args, add_parallel_args, add_training_args, add_data_args):
        add(p)
    args = p.parse_args(argv)
    _, vocab_size = pretrain_tokenizer(args, "gpt")  # the config needs the vocabulary first
    cfg = build_config(args, "gpt", world_size, vocab_size=vocab_size).config
    n = cfg.train.train_iters * cfg.batch.global_batch_size
    data = build_gpt_train_data(args, cfg.model.seq_length, cfg.train.seed, n)
    assert data.vocab_size == cfg.model.vocab_size
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    engine = build_engine(cfg, grid, torch.device("cpu"))
    batches = GPTBatches(data.dataset, cfg.batch.micro_batch_size,
                         cfg.num_microbatches, grid.data, grid.dp_rank)
    engine.start(cfg.train.train_iters)
    losses = [engine.train_batch(batches) for _ in range(cfg.train.train_iters)]
    if grid.is_last_stage:
        torch.save(torch.stack(losses).tolist(), out)
