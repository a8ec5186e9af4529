"""BERT dataset: sample layout, masking statistics (15%, 80/10/10), SOP/NSP labels, short
sequences, caching; and the default-corpus BERT entry point."""
import argparse

import numpy as np
import pytest
import torch

from megatron_2bw.data.bert_dataset import BertDataset
from megatron_2bw.data.build import build_bert_train_data
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset

SEQ = 64


class FakeTokenizer:
    vocab_size, pad, cls, sep, mask = 6000, 0, 1, 2, 3
    special_ids = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 documents of 4-12 sentences; token ids increase through the corpus (from 10), so a
    token tells its document and its order."""
    d = tmp_path_factory.mktemp("bert")
    rng, nxt, doc_of = np.random.RandomState(0), 10, {}
    b = IndexedDatasetBuilder(str(d / "s.bin"), np.uint16)
    for k in range(60):
        lengths = rng.randint(3, 16, size=rng.randint(4, 13)).tolist()
        ids = list(range(nxt, nxt + sum(lengths)))
        doc_of.update({t: k for t in ids})
        nxt += sum(lengths)
        b.add_document(ids, lengths)
    b.finalize(str(d / "s.idx"))
    return MMapIndexedDataset(str(d / "s")), doc_of, d


def make(corpus, n=2000, **kw):
    ds, _, d = corpus
    return BertDataset(ds, range(0, 60), FakeTokenizer(), n, SEQ, seed=11, cache_dir=d / "c", **kw)


def originals(s):
    return torch.where(s["loss_mask"].bool(), s["labels"], s["tokens"])


def test_sample_layout(corpus):
    bert = make(corpus, short_seq_prob=0.2)
    for i in range(200):
        s = bert[i]
        assert set(s) >= {"tokens", "types", "labels", "loss_mask", "padding_mask", "is_random"}
        assert all(v.dtype == torch.int64 for v in s.values())
        n = int(s["padding_mask"].sum())
        tok, types = s["tokens"], s["types"]
        assert tok.shape == (SEQ,) and tok[0] == 1 and tok[n - 1] == 2 and (tok[n:] == 0).all()
        assert s["padding_mask"][:n].all() and (s["types"][n:] == 0).all()
        seps = (originals(s)[:n] == 2).nonzero().flatten().tolist()
        assert len(seps) == 2 and seps[1] == n - 1
        assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:n] == 1).all()
        lm = s["loss_mask"].bool()
        assert (s["labels"][~lm] == -1).all() and (s["labels"][lm] >= 10).all()
        assert not lm[[0] + seps].any()  # never [CLS] / [SEP]


def test_masking_statistics(corpus):
    bert = make(corpus, short_seq_prob=0.0)
    masked = content = as_mask = kept = 0
    for i in range(1500):
        s = bert[i]
        lm = s["loss_mask"].bool()
        content += int((originals(s)[s["padding_mask"].bool()] >= 10).sum())
        masked += int(lm.sum())
        as_mask += int((s["tokens"][lm] == 3).sum())
        kept += int((s["tokens"][lm] == s["labels"][lm]).sum())
    assert abs(masked / content - 0.15) < 0.015
    assert abs(as_mask / masked - 0.8) < 0.02
    assert abs(kept / masked - 0.1) < 0.02
    assert abs((masked - as_mask - kept) / masked - 0.1) < 0.02


def test_sentence_order_labels(corpus):
    bert = make(corpus, pair_task="sop")
    labels = []
    for i in range(400):
        s = bert[i]
        orig, types, real = originals(s), s["types"], s["padding_mask"].bool()
        a = orig[(types == 0) & real & (orig >= 10)]
        b = orig[(types == 1) & real & (orig >= 10)]
        swapped = bool(a.min() > b.max())
        assert swapped or bool(a.max() < b.min())
        assert int(s["is_random"]) == swapped
        labels.append(swapped)
    assert abs(np.mean(labels) - 0.5) < 0.08


def test_next_sentence_labels(corpus):
    bert = make(corpus, pair_task="nsp")
    _, doc_of, _ = corpus
    labels = []
    for i in range(400):
        s = bert[i]
        orig, types, real = originals(s), s["types"], s["padding_mask"].bool()
        a = orig[(types == 0) & real & (orig >= 10)].tolist()
        b = orig[(types == 1) & real & (orig >= 10)].tolist()
        same_doc = doc_of[a[0]] == doc_of[b[0]]
        assert int(s["is_random"]) == (not same_doc)
        if same_doc:
            assert max(a) < min(b)
        labels.append(not same_doc)
    assert abs(np.mean(labels) - 0.5) < 0.08


def test_short_seq_prob_and_single_segment(corpus):
    long_only = make(corpus, short_seq_prob=0.0)
    assert (long_only.samples_mapping[:, 2] == SEQ - 3).all()
    short = make(corpus, short_seq_prob=0.5)
    frac = np.mean(short.samples_mapping[:, 2] < SEQ - 3)
    assert 0.4 < frac < 0.6
    lens = [int(short[i]["padding_mask"].sum()) for i in range(300)]
    assert min(lens) < SEQ // 2 and max(lens) > SEQ - 8
    single = make(corpus, binary_head=False)
    s = single[0]
    assert int(s["is_random"]) == 0 and (s["types"] == 0).all()


def test_deterministic_and_cached(corpus):
    one, two = make(corpus, n=300), make(corpus, n=300)
    assert not two.built_indices
    for i in (0, 17, 299):
        assert all(torch.equal(one[i][k], two[i][k]) for k in one[i])
    with pytest.raises(DataError, match="sop or nsp"):
        make(corpus, pair_task="xyz")


def test_bert_on_default_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_2BW_CACHE", str(tmp_path))
    data = build_bert_train_data(argparse.Namespace(seq_length=128, seed=1), num_samples=64)
    tok = data.tokenizer
    assert data.vocab_size == 2048 and tok.cls >= 2000
    s = data.dataset[0]
    assert s["tokens"][0] == tok.cls and int(s["loss_mask"].sum()) > 0
    text = tok.detokenize(s["tokens"][s["padding_mask"].bool()].tolist())
    assert "<CLS>" in text and "<SEP>" in text
