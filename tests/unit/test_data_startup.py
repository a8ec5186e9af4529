"""Start-up at scale, the data half (issue 29, point 5): the checks that read a whole .idx or
.bin run once per file version and are cached (a second build, or another rank, re-reads
neither); a failure is cached as its line, so every rank raises the same one; a rank that reads
no data (a middle pipeline stage) opens no .bin, reads only the .idx header and no cache, and
still sizes the splits as the data ranks do; the node's cache builder is its first data rank."""
import argparse

import pytest

from megatron_2bw.config.build import build_config
from megatron_2bw.config.flags import add_model_args, add_parallel_args, add_training_args
from megatron_2bw.data import consistency, indexed_dataset
from megatron_2bw.data.build import NO_DATA, build_pretrain_data, open_checked
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.flags import add_data_args
from megatron_2bw.data.tokenizer import NullTokenizer
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.build import data_role
from test_data_gpt import make_dataset


@pytest.fixture
def counted(monkeypatch):
    """Counts of the whole-.idx check and the whole-.bin scan."""
    calls = {"idx": 0, "bin": 0}
    check = indexed_dataset.IndexReader._check_lengths_and_pointers
    scan = consistency.scan_token_range

    def counting_check(self):
        calls["idx"] += 1
        return check(self)

    def counting_scan(ds):
        calls["bin"] += 1
        return scan(ds)
    monkeypatch.setattr(indexed_dataset.IndexReader, "_check_lengths_and_pointers",
                        counting_check)
    monkeypatch.setattr(consistency, "scan_token_range", counting_scan)
    return calls


def test_a_second_build_and_another_rank_do_not_rescan(tmp_path, counted):
    data = make_dataset(tmp_path / "d")
    tokenizer, cache = NullTokenizer(60000), str(tmp_path / "c")
    first = open_checked([data], tokenizer, cache, builder=True)
    assert counted == {"idx": 1, "bin": 1}
    again = open_checked([data], tokenizer, cache, builder=True)  # a later run
    other = open_checked([data], tokenizer, cache, builder=False)  # another rank of the node
    assert counted == {"idx": 1, "bin": 1}
    for ds in (again[0], other[0]):
        assert ds.num_tokens == first[0].num_tokens and ds[7].tolist() == first[0][7].tolist()
    make_dataset(tmp_path / "d", num_docs=40)
    assert len(open_checked([data], tokenizer, cache, builder=True)[0]) == 40  # rewritten
    assert counted == {"idx": 2, "bin": 2}


def test_a_corrupt_index_is_the_same_line_on_every_rank_and_checked_once(tmp_path, counted):
    data = make_dataset(tmp_path / "d")
    idx = tmp_path / "d.idx"
    raw = bytearray(idx.read_bytes())
    raw[34 + 4 * 50 + 8 * 3] ^= 0x01  # a pointer: the lengths before it no longer add up
    idx.write_bytes(bytes(raw))
    tokenizer, cache = NullTokenizer(60000), str(tmp_path / "c")
    lines = []
    for builder in (True, False, False):
        with pytest.raises(DataError) as e:
            open_checked([data], tokenizer, cache, builder=builder)
        lines.append(str(e.value))
    assert counted["idx"] == 1 and len(set(lines)) == 1 and "\n" not in lines[0]
    assert lines[0].startswith(f"{idx}: sequence 3 starts at byte") and "corrupt index" in lines[0]


def _args(data, split):
    """pretrain_gpt.py's data flags for `data` (a prefix, or a list: blended 1:1)."""
    data = [data] if isinstance(data, str) else [x for d in data for x in ("1", d)]
    p = argparse.ArgumentParser()
    for add in (add_model_args, add_parallel_args, add_training_args):
        add(p)
    add_data_args(p, "gpt")
    return p.parse_args(["--seq-length", "16", "--train-iters", "4", "--global-batch-size", "8",
                         "--data-path", *data, "--tokenizer-type", "NullTokenizer",
                         "--vocab-size", "60000", "--split", split])


@pytest.mark.parametrize("split,valid", [("90,10,0", True), ("100,0,0", False)])
def test_a_middle_stage_opens_no_data_and_sizes_the_splits_alike(tmp_path, monkeypatch, split,
                                                                 valid):
    data = make_dataset(tmp_path / "d")
    args = _args(data, split)
    ends = build_pretrain_data(args, "gpt", valid_samples=16)
    assert (ends.valid is not None) == valid
    opened = []
    real_open = open

    def watched_open(path, *a, **k):
        opened.append(str(path))
        return real_open(path, *a, **k)

    def refuse(*a, **k):
        raise AssertionError("a middle stage opened the data")
    monkeypatch.setattr("builtins.open", watched_open)
    monkeypatch.setattr(indexed_dataset.np, "memmap", refuse)
    monkeypatch.setattr(indexed_dataset.IndexReader, "__init__", refuse)
    monkeypatch.setattr(consistency, "cached_arrays", refuse)
    middle = build_pretrain_data(args, "gpt", valid_samples=16, reads=False)
    assert middle.train is NO_DATA and middle.valid is (NO_DATA if valid else None)
    assert middle.vocab_size == ends.vocab_size
    assert opened == [f"{data}.idx"], "the 34-byte header only"
    with pytest.raises(DataError, match="reads no data"):
        middle.train[0]


def test_a_middle_stage_names_an_empty_train_split_as_the_data_ranks_do(tmp_path):
    data = make_dataset(tmp_path / "d")
    lines = []
    for reads in (True, False):
        with pytest.raises(DataError) as e:
            build_pretrain_data(_args(data, "0,100,0"), "gpt", reads=reads)
        lines.append(str(e.value))
    assert lines[0] == lines[1] and "the train split has weight 0" in lines[0]
    small = make_dataset(tmp_path / "small", num_docs=3)  # 10% of 3 documents rounds to none
    lines = []
    for reads in (True, False):
        with pytest.raises(DataError) as e:
            build_pretrain_data(_args([data, small], "90,10,0"), "gpt", valid_samples=8,
                                reads=reads)
        lines.append(str(e.value))
    assert lines[0] == lines[1] and f"{small} has no documents in the valid split" in lines[0]


@pytest.mark.parametrize("d,order,per_node,builders", [
    (1, "tp-dp-pp", 4, [0, 4]),                # every rank reads: local rank 0 builds
    (4, "tp-dp-pp", 2, [0, 6]),                # stage = rank // 2: node 1 (2, 3) is stage 1
    (4, "tp-pp-dp", 2, [0, 3, 4, 7]),          # stage = rank % 4: local rank 0 of node 1
                                               # (rank 2) is stage 2: rank 3 builds there
])
def test_the_node_builder_is_its_first_rank_that_reads_data(d, order, per_node, builders):
    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--mock-data", "--pipeline-model-parallel-size", str(d), "--rank-order", order,
            "--pipeline-schedule", "flush"]
    cfg = build_config(build_parser("gpt").parse_args(argv), "gpt", 8).config
    def node(r):
        return list(range(r - r % per_node, r - r % per_node + per_node))
    roles = [data_role(cfg, r, 8, node(r)) for r in range(8)]
    assert [r for r, (_, b) in enumerate(roles) if b] == builders
    stage = [r // (8 // d) if order == "tp-dp-pp" else r % d for r in range(8)]
    assert [reads for reads, _ in roles] == [s in (0, d - 1) for s in stage]
    # a node whose ranks are not contiguous (srun's cyclic distribution: rank r on node r % 2)
    cyclic = [data_role(cfg, r, 8, list(range(r % 2, 8, 2))) for r in range(8)]
    for host in (0, 1):
        readers = [r for r in range(host, 8, 2) if cyclic[r][0]]
        assert [r for r in range(host, 8, 2) if cyclic[r][1]] == readers[:1]  # never none
    # nobody says which ranks share a node: every reader builds (harmless, never a wait)
    assert [data_role(cfg, r, 8, None) for r in range(8)] == [(x, x) for x, _ in roles]


def test_the_launcher_names_the_ranks_of_this_node(monkeypatch):
    from megatron_2bw.parallel.launcher import node_ranks
    for var in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "SLURM_GTIDS", "SLURM_PROCID",
                "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert node_ranks(5, 1) is None
    monkeypatch.setenv("SLURM_GTIDS", "1,3,5,7")  # srun --distribution=cyclic, node 1 of 2
    monkeypatch.setenv("SLURM_PROCID", "5")
    assert node_ranks(5, 2) == [1, 3, 5, 7]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun per node: a contiguous block
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert node_ranks(5, 1) == [4, 5, 6, 7]
