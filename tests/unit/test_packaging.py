"""The package as an installed library: pyproject.toml's metadata (the torch range is the one
this torch proves), every console script and every tools/ file is a command with --help whose
code lives in the package, and no private torch.distributed.checkpoint module is imported
(checkpoint/dist/storage.py's `_reads` does what planner_helpers did, with public types).
tests/e2e/test_wheel.py builds and installs the wheel."""
import ast
import importlib
import importlib.util
import random
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
META = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _target(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def test_the_torch_range_holds_the_tested_torch_and_nothing_untested():
    (torch_req,) = [r for r in META["dependencies"] if r.startswith("torch")]
    spec = SpecifierSet(torch_req[len("torch"):])
    here = Version(torch.__version__.split("+")[0])
    assert here in spec, f"{torch_req} leaves out the torch the tests run on ({here})"
    # only this minor release is tested: the next and the previous ones are outside the range
    assert Version(f"{here.major}.{here.minor + 1}") not in spec
    assert Version(f"{here.major}.{here.minor - 1}") not in spec


def test_metadata_license_and_the_readme_commands_are_console_scripts():
    assert META["license"] == {"text": "Apache-2.0"}
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    scripts = META["scripts"]
    for name in ("pretrain-gpt", "pretrain-bert", "preprocess-data", "train-tokenizer", "plan",
                 "convert", "inspect", "generate", "compare-convergence", "plot-schedule",
                 "verify", "gpu-check"):
        assert callable(_target(scripts[f"m2bw-{name}"])), name


@pytest.mark.parametrize("script", sorted(META["scripts"]))
def test_every_console_script_has_help(script, capsys):
    with pytest.raises(SystemExit) as e:
        _target(META["scripts"][script])(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def _tool(path: Path):
    spec = importlib.util.spec_from_file_location(f"_tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", sorted((ROOT / "tools").glob("*.py")), ids=lambda p: p.name)
def test_every_tools_file_is_a_thin_command_over_the_package(path, capsys):
    tree = ast.parse(path.read_text())
    guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guards, f"{path.name} is not a command: move it into megatron_2bw/cli/"
    assert not [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))], \
        f"{path.name} defines code: it belongs in the package, the tool only wraps it"
    main = _tool(path).main
    assert main.__module__.startswith("megatron_2bw."), main.__module__
    assert f"{main.__module__}:main" in META["scripts"].values()
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def test_no_private_torch_checkpoint_module_is_imported():
    for path in (ROOT / "megatron_2bw").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not [n for n in names if "planner_helpers" in n], path


def test_reads_are_torchs_resharding_reads():
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata,
                                                       TensorStorageMetadata, TensorProperties)
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from megatron_2bw.checkpoint.dist.storage import _reads
    rng = random.Random(0)

    def split(n):
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(2, n - 1))))
        return list(zip([0, *cuts], [*cuts, n]))
    for _ in range(30):
        shape = [rng.randint(2, 9) for _ in range(rng.randint(1, 3))]
        chunks = [ChunkStorageMetadata(torch.Size([a for a, _ in box]),
                                       torch.Size([b - a for a, b in box]))
                  for box in _product([split(n) for n in shape])]
        lo = [rng.randrange(n) for n in shape]
        want = ChunkStorageMetadata(torch.Size(lo), torch.Size(
            [rng.randint(1, n - a) for a, n in zip(lo, shape)]))
        md = TensorStorageMetadata(TensorProperties(), torch.Size(shape), chunks)
        theirs = create_read_items_for_chunk_list("w", md, [want])
        ours = _reads("w", chunks, want, 0)
        key = lambda r: tuple(r.storage_index.offset)  # noqa: E731
        assert sorted(ours, key=key) == sorted(theirs, key=key)


def _product(axes):
    out = [[]]
    for ranges in axes:
        out = [box + [r] for box in out for r in ranges]
    return out
