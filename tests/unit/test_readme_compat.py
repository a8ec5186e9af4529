"""What the README must keep saying about the peers (issue 45 Build point 6, issue 49's "the
rule"), whatever else a rewrite changes:

- a table of which checkpoint format carries what, with a row for every format and writer
  `--load` detects (checkpoint/megatron/detect.py: ours torch_dist / torch, ours in
  megatron-core's format, megatron-core's torch_dist, Megatron's torch format, DeepSpeed's
  pipeline layout), and a column for each thing a run carries over;
- which peer's meaning wins where Megatron-LM and Megatron-DeepSpeed disagree, naming the flags
  they conflict on as config/compat.py and mds_flags.py take them."""
import re
from pathlib import Path

from megatron_2bw.config.build import build_config
from megatron_2bw.pretrain import build_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()

# a row's first cell -> words that name the format (one row each)
ROWS = {"ours torch_dist": ("`torch_dist` (ours)",),
        "ours torch": ("`torch` (ours)",),
        "ours for Megatron": ("--ckpt-format megatron", "ours"),
        "megatron-core": ("megatron-core torch_dist",),
        "Megatron torch": ("Megatron `--ckpt-format torch`", "legacy"),
        "DeepSpeed": ("DeepSpeed pipeline", "Megatron-DeepSpeed")}
COLUMNS = ("weights", "iteration", "lr schedule", "Adam moments", "RNG", "loads into")


def checkpoint_table() -> list[list[str]]:
    tables = re.findall(r"((?:^\|.*\|\n)+)", README, re.M)
    found = [t for t in tables if t.startswith("| format") and "Adam moments" in t.split("\n")[0]]
    assert len(found) == 1, "README.md has no table of which checkpoint format carries what"
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in found[0].splitlines() if not line.startswith("|---")]


def test_the_readme_says_which_checkpoint_format_carries_what():
    header, *rows = checkpoint_table()
    assert all(any(c in h for h in header) for c in COLUMNS), header
    for name, words in ROWS.items():
        match = [r for r in rows if all(w in r[0] for w in words)]
        assert len(match) == 1, (name, [r[0] for r in rows])
        assert len(match[0]) == len(header) and all(match[0]), (name, match[0])
    assert len(rows) == len(ROWS)
    assert "not written by megatron-2bw: files not verified" in " ".join(README.split())


def test_the_readme_states_which_peers_meaning_wins():
    at = README.find("Which meaning wins")
    assert at > 0, "README.md does not state the rule for Megatron-LM vs Megatron-DeepSpeed"
    rule = " ".join(README[at:README.find("\n\n", at)].split())
    for words in ("agree nothing changes", "only one of them has", "Megatron-DeepSpeed's",
                  "either spelling"):
        assert words in rule, words
    # the flags it names as conflicts are taken with Megatron-DeepSpeed's meaning, said in a line
    for flag, value in (("--checkpoint-activations", []), ("--data-impl", ["mmap"])):
        assert f"`{flag}`" in rule, flag
        notes = build_config(build_parser("gpt").parse_args(["--mock-data", flag, *value]),
                             "gpt", 1).notes
        assert any(n.startswith(f"megatron-2bw: {flag}") and "Megatron-DeepSpeed" in n
                   for n in notes), (flag, notes)
