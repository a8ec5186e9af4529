"""Blends in megatron-core's order: per-component sample counts, dataset index and dataset-sample
index equal to what its BlendedMegatronDatasetBuilder + BlendedDataset + helpers.cpp give.

The expected values come from a small independent reference of Megatron's algorithm written
here from its documented behaviour (not from megatron_2bw's code):
- weights normalized in float64; each component is asked for ceil(ceil(n * w) * 1.005) samples
  (_get_size_per_split_per_dataset with mid_level_dataset_surplus 0.005), the blend has
  sum(ceil(n * w)) samples;
- no weights: each component is one epoch, weighted by its number of samples, the blend has
  min(n, their sum) samples;
- the split matrix: split k holds documents [round(c_k * D), round(c_k+1 * D));
- build_blending_indices: sample i from the component with the largest w * max(i, 1) - count.
"""
import math

import numpy as np
import pytest

from megatron_2bw.data.blended_dataset import BlendedDataset
from megatron_2bw.data.build import build_gpt_datasets
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.indexed_dataset import IndexedDatasetBuilder


def ref_greedy(weights, size):
    w = [float(x) for x in np.asarray(weights, np.float64) / np.sum(np.asarray(weights,
                                                                             np.float64))]
    counts, index, sample = [0] * len(w), [], []
    for i in range(size):
        errors = [w[d] * max(float(i), 1.0) - counts[d] for d in range(len(w))]
        d = errors.index(max(errors))  # the first of equal maxima, as the C++ loop's ">"
        index.append(d)
        sample.append(counts[d])
        counts[d] += 1
    return index, sample


def ref_documents(split, num_docs):
    parts = [float(x) for x in split.split(",")]
    parts = [x / sum(parts) for x in parts]
    cum = [0.0]
    for x in parts:
        cum.append(cum[-1] + x)
    return [(int(round(cum[k] * num_docs)), int(round(cum[k + 1] * num_docs))) for k in range(3)]


def make_dataset(path, num_docs, seed):
    rng = np.random.RandomState(seed)
    b = IndexedDatasetBuilder(f"{path}.bin", np.int32)
    lengths = []
    for k in range(num_docs):
        n = int(rng.randint(1, 30))
        lengths.append(n)
        b.add_document(1000 * k + np.arange(n), [n])
    b.finalize(f"{path}.idx")
    return str(path), lengths


def test_weighted_0_3_0_7_at_16187_samples(tmp_path):
    a, _ = make_dataset(tmp_path / "a", 40, 1)
    b, _ = make_dataset(tmp_path / "b", 40, 2)
    train, _, _ = build_gpt_datasets(["0.3", a, "0.7", b], "1", 4, 5, (16187, 0, 0),
                                     str(tmp_path / "c"))
    # Megatron: components asked for ceil(ceil(16187 * w) * 1.005) = 4882 and 11388 samples
    assert [d.description["num_samples"] for d in train.datasets] == [4882, 11388]
    assert len(train) == math.ceil(16187 * 0.3) + math.ceil(16187 * 0.7) == 16188
    index, sample = ref_greedy([0.3, 0.7], 16188)
    assert train.dataset_index.tolist() == index
    assert train.dataset_sample_index.tolist() == sample
    assert np.bincount(train.dataset_index).tolist() == [4857, 11331]


@pytest.mark.parametrize("weights", [None, ("0.25", "0.5", "0.25")])
def test_blend_on_every_split(tmp_path, weights):
    """Unweighted (`--data-path A B C`: weights from the components' one-epoch sample counts,
    the test split capped at their total) and weighted, on train, valid and test."""
    seq, split, sizes = 4, "90,5,5", (500, 30, 40)
    made = [make_dataset(tmp_path / f"d{k}", n, k) for k, n in enumerate((50, 70, 30))]
    prefixes = [p for p, _ in made]
    data_path = prefixes if weights is None else [x for wp in zip(weights, prefixes)
                                                  for x in wp]
    out = build_gpt_datasets(data_path, split, seq, 3, sizes, str(tmp_path / "c"))
    for s, (ds, n) in enumerate(zip(out, sizes)):
        # one epoch of a component: (tokens of its split's documents - 1) // seq samples
        epoch = []
        for _, lengths in made:
            beg, end = ref_documents(split, len(lengths))[s]
            epoch.append((sum(lengths[beg:end]) - 1) // seq)
        if weights is None:
            w, size = epoch, min(n, sum(epoch))
            assert [len(d) for d in ds.datasets] == epoch
        else:
            w = [float(x) for x in weights]
            asked = [math.ceil(math.ceil(n * x) * (1 + 0.005)) for x in w]
            assert [d.description["num_samples"] for d in ds.datasets] == asked
            size = sum(math.ceil(n * x) for x in w)
        assert len(ds) == size
        index, sample = ref_greedy(w, size)
        assert ds.dataset_index.tolist() == index, f"split {s}"
        assert ds.dataset_sample_index.tolist() == sample, f"split {s}"
    if weights is None:
        assert len(out[2]) < sizes[2]  # the test split is capped at its components' total


def test_exhaustive_blend_and_oversampling(tmp_path):
    class Fake:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return i

    ds = BlendedDataset([Fake(3), Fake(5)], [3, 5], None, tmp_path / "c")
    assert np.bincount(ds.dataset_index).tolist() == [3, 5] and len(ds) == 8
    for d, n in enumerate((3, 5)):  # each sample of each component exactly once, in order
        assert ds.dataset_sample_index[ds.dataset_index == d].tolist() == list(range(n))
    with pytest.raises(DataError, match="needs 5 samples of dataset 1 but it has 4"):
        BlendedDataset([Fake(10), Fake(4)], [0.5, 0.5], 10, tmp_path / "c")


def test_component_without_documents_in_a_split(tmp_path):
    a, _ = make_dataset(tmp_path / "a", 40, 1)
    b, _ = make_dataset(tmp_path / "b", 5, 2)
    with pytest.raises(DataError, match="has no documents in the test split"):
        build_gpt_datasets([a, b], "90,5,5", 4, 1, (50, 5, 5), str(tmp_path / "c"))


def test_one_weighted_prefix_is_a_blend(tmp_path):
    """`--data-path 1.0 A`: Megatron builds a BlendedDataset of one component asked for
    ceil(ceil(n) * 1.005) samples (so its shuffle differs from plain `--data-path A`)."""
    a, _ = make_dataset(tmp_path / "a", 40, 1)
    weighted, _, _ = build_gpt_datasets(["1.0", a], "1", 4, 5, (1000, 0, 0), str(tmp_path / "c"))
    plain, _, _ = build_gpt_datasets([a], "1", 4, 5, (1000, 0, 0), str(tmp_path / "c"))
    assert isinstance(weighted, BlendedDataset) and len(weighted) == 1000
    assert weighted.datasets[0].description["num_samples"] == math.ceil(1000 * 1.005) == 1005
    assert weighted.dataset_sample_index.tolist() == list(range(1000))
    assert plain.description["num_samples"] == 1000


def test_unweighted_blend_shorter_than_training_is_one_line(tmp_path):
    import argparse
    from megatron_2bw.data.build import build_gpt_train_data
    a, _ = make_dataset(tmp_path / "a", 10, 1)
    b, _ = make_dataset(tmp_path / "b", 10, 2)
    args = argparse.Namespace(data_path=[a, b], split="1", tokenizer_type="NullTokenizer",
                              vocab_size=10 ** 5, data_cache_path=str(tmp_path / "c"))
    assert len(build_gpt_train_data(args, seq_length=4, seed=1, num_samples=20).dataset) == 20
    with pytest.raises(DataError, match="an unweighted blend is one epoch of its prefixes, "
                                        r"\d+ samples, but training needs 5000: give weights"):
        build_gpt_train_data(args, seq_length=4, seed=1, num_samples=5000)
    from megatron_2bw.data.build import build_pretrain_data
    args.split = "50,50,0"
    with pytest.raises(DataError, match=r"but evaluation needs 900"):
        build_pretrain_data(args, "gpt", 4, 1, train_samples=10, valid_samples=900)
