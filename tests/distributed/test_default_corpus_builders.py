"""The embedded default corpus in processes: three builders at once get the same files, and
the README's run on two ranks learns below the corpus's unigram entropy (-m slow); helpers in
tests/unit/test_data_default_corpus.py."""
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_2bw.data.default_corpus import default_corpus_unigram_entropy
from test_data_default_corpus import (_train_on_default_corpus, cache, digest,  # noqa: F401
                                      readme_run)  # (cache: a fixture)


def test_concurrent_builders_agree(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        results = pool.map(digest, [str(tmp_path)] * 3)
    assert all(r == results[0] for r in results)
    corpus_dir = Path(results[0][0])
    assert set(results[0][1]) == {"tokenizer.model", "topics_text_document.bin",
                                  "topics_text_document.idx", "topics_text_sentence.bin",
                                  "topics_text_sentence.idx"}
    leftovers = [p.name for p in corpus_dir.parent.iterdir() if ".tmp-" in p.name]
    assert not leftovers
    stamp = (corpus_dir / "tokenizer.model").stat().st_mtime_ns
    assert digest(str(tmp_path)) == results[0]  # a later start reuses it
    assert (corpus_dir / "tokenizer.model").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_readme_run_on_default_corpus_beats_unigram_entropy(cache):
    from megatron_2bw.training.spawn import spawn
    entropy = default_corpus_unigram_entropy()
    out = str(cache / "losses.pt")
    spawn(_train_on_default_corpus, 2, (readme_run(), out))
    losses = torch.load(out)
    assert losses[0] > entropy + 0.5  # starts near ln(vocab)
    final = float(np.mean(losses[-10:]))
    assert final < entropy, f"final loss {final:.3f} >= unigram entropy {entropy:.3f}"
