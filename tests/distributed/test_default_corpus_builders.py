"""The embedded default corpus built by three processes at once: every one gets the same files
(helpers in tests/unit/test_data_default_corpus.py)."""
import multiprocessing
from pathlib import Path

from test_data_default_corpus import digest


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
