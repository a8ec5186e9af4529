"""The package's layout rules (docs/ARCHITECTURE.md, "Package map"), checked on the source:

- the package order: docs/ARCHITECTURE.md states the packages bottom to top (`order: fs <
  schedule < ...`), every package and root module has its place, and no import points up it:
  imports at module level, inside functions and under `if TYPE_CHECKING:` all count, as do the
  package `__init__`s an import runs, with no exception (the test prints its count: 0);
- no import circle among the package's modules, counting imports inside functions and the
  package `__init__` files an import runs (importing `a.b.c` from outside `a.b` runs `a/__init__`
  and `a/b/__init__` first);
- nothing outside megatron_2bw/testing/ (the judges) imports testing/, and nothing outside cli/
  (the commands) imports cli/;
- each package's `__init__` docstring says what it owns (`Owns:`) and what it must not import
  (`Must not import: a, b.`), and no module of the package imports what its package forbids;
- schedule/ is pure (no torch); no product file is over 400 lines; the package root holds only
  entry points, fs.py and the DeepSpeed `pipe` name.
Each rule is also shown to fail on a planted violation."""
from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_2bw"
ROOT_MODULES = {"__init__.py", "pretrain.py", "generate.py", "fs.py", "pipe.py"}
MAX_LINES = 400
ORDER_DOC = ROOT / "docs" / "ARCHITECTURE.md"


# -- the graph ---------------------------------------------------------------------------------
def modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package_dir` (a package `a.b` is its
    `__init__.py`)."""
    name = package_dir.name
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [name, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `module` imports anywhere in its file (functions and TYPE_CHECKING
    blocks included): `from x import y` counts `x.y` when that is a module, else `x` (an
    import runs the `__init__` of `x` either way: `import_graph` adds those)."""
    tree = ast.parse(path.read_text())
    top = module.split(".")[0]
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            subs = {f"{base}.{a.name}" for a in node.names} & known
            names |= subs
            if len(subs) < len(node.names):  # names defined in `base` itself
                names.add(base)
    out = set()
    for name in names:
        if name != top and not name.startswith(top + "."):
            continue
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known:
            out.add(name)
    return out


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """module -> the modules importing it runs: what it imports, plus the package `__init__`s of
    each import that lie outside the importer's own packages (those run already)."""
    found = modules(package_dir)
    known = set(found)
    graph = {}
    for module, path in found.items():
        edges = set()
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        if path.name == "__init__.py":
            own.add(module)
        for target in imported(module, path, known):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                ancestor = ".".join(parts[:i])
                if ancestor in known and (ancestor == target or ancestor not in own):
                    edges.add(ancestor)
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def judges_imported_by(graph: dict[str, set[str]], top: str) -> list[str]:
    """Only the judges (testing/) import the judges, the commands (cli/: what tools/ wraps)
    included, and only the commands import the commands."""
    judges, commands = f"{top}.testing", f"{top}.cli"
    inside = lambda m, p: m == p or m.startswith(p + ".")  # noqa: E731
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                  if (inside(t, judges) and not inside(m, judges))
                  or (inside(t, commands) and not inside(m, commands)))


# -- the package order ---------------------------------------------------------------------------
def package_order(text: str) -> list[list[str]]:
    """The levels of the order a document states, bottom first: the `order:` line and the lines
    that continue it (up to a blank line), `<` between levels, spaces or commas between the
    names of one level. A package is its folder's name, a root module its file's stem
    (`__init__`: the package root)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("order:")), None)
    stated = [] if start is None else list(itertools.takewhile(str.strip, lines[start:]))
    levels = " ".join(stated).replace("order:", "", 1).split("<")
    return [level.replace(",", " ").split() for level in levels] if stated else []


def unit(module: str) -> str:
    """The package (or root module) `module` belongs to: `top.a.b` -> `a`, `top` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def units(package_dir: Path) -> set[str]:
    return {unit(m) for m in modules(package_dir)}


def climbing_imports(graph: dict[str, set[str]], order: list[list[str]]) -> list[str]:
    """'importer -> imported' for every import that points up `order` (from a package to one of
    a later level). A package missing from `order` ranks above everything: any import of it
    climbs (and test_the_order_places_every_package_once names it)."""
    rank = {name: i for i, level in enumerate(order) for name in level}
    top = len(order)
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                  if rank.get(unit(t), top) > rank.get(unit(m), top))


def forbidden(package_dir: Path) -> dict[str, list[str]]:
    """Package -> the top-level names its `__init__` docstring says it must not import."""
    out = {}
    for module, path in modules(package_dir).items():
        if path.name != "__init__.py" or module == package_dir.name:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        m = re.search(r"Must not import:(.*?)\.(\s|$)", doc, re.S)
        out[module] = [] if m is None else [n.strip() for n in m.group(1).split(",") if n.strip()]
    return out


def broken_promises(package_dir: Path) -> list[str]:
    top = package_dir.name
    found = modules(package_dir)
    known = set(found)
    bad = []
    for package, names in forbidden(package_dir).items():
        banned = [f"{top}.{n}" for n in names]
        for module, path in found.items():
            if module != package and not module.startswith(package + "."):
                continue
            for target in imported(module, path, known):
                hit = [b for b in banned if target == b or target.startswith(b + ".")]
                if hit:
                    bad.append(f"{module} imports {target}: {package} must not import {hit[0]}")
    return bad


# -- the package ---------------------------------------------------------------------------------
def test_the_order_places_every_package_once():
    order = package_order(ORDER_DOC.read_text())
    placed = [name for level in order for name in level]
    assert len(order) > 10, f"{ORDER_DOC.name}: no `order: a < b < ...` line in its Package map"
    assert len(placed) == len(set(placed)), f"placed twice in the package order: {placed}"
    missing = sorted(units(PACKAGE) - set(placed))
    assert not missing, (f"place these in the package order ({ORDER_DOC.name}, Package map): "
                         f"{missing}")
    assert not set(placed) - units(PACKAGE), \
        f"the package order names what the package lacks: {sorted(set(placed) - units(PACKAGE))}"


def test_no_import_climbs_the_package_order():
    found = climbing_imports(import_graph(PACKAGE), package_order(ORDER_DOC.read_text()))
    print(f"imports climbing the package order: {len(found)}")
    assert len(found) == 0, (f"{len(found)} imports climb the package order ({ORDER_DOC.name}, "
                             f"Package map; move the code down, no exceptions): {found}")


def test_the_package_has_no_import_circle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 100 and "megatron_2bw.pipeline.engine" in graph
    assert not cycles(graph), f"import circles (break each one): {cycles(graph)}"


def test_nothing_but_testing_imports_testing():
    assert not judges_imported_by(import_graph(PACKAGE), "megatron_2bw"), \
        "the product imports its judges (megatron_2bw/testing/): " + \
        "; ".join(judges_imported_by(import_graph(PACKAGE), "megatron_2bw"))


def test_every_package_says_what_it_owns_and_must_not_import():
    missing = []
    for module, path in modules(PACKAGE).items():
        if path.name != "__init__.py" or module == "megatron_2bw":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if "Owns:" not in doc or "Must not import:" not in doc:
            missing.append(module)
    assert not missing, f"package docstrings without 'Owns:' / 'Must not import:': {missing}"
    assert all("testing" in names for p, names in forbidden(PACKAGE).items()
               if not p.startswith(("megatron_2bw.testing", "megatron_2bw.cli")))


def test_no_package_imports_what_it_must_not():
    assert not broken_promises(PACKAGE), "; ".join(broken_promises(PACKAGE))


def torch_imports(directory: Path) -> list[str]:
    """'file: module' of every torch import under `directory` (functions included)."""
    out = []
    for path in sorted(directory.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            out += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "torch"]
    return out


def test_the_schedule_package_is_pure():
    assert not torch_imports(PACKAGE / "schedule"), \
        f"schedule/ must stay pure data (no torch): {torch_imports(PACKAGE / 'schedule')}"


def test_no_product_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concern (at most {MAX_LINES} lines): {long}"


def test_test_files_have_unique_names():
    """Test modules are imported by their basename (rootdir-relative, no packages): two files of
    one name in tests/unit and tests/distributed break collection, and spawned ranks unpickle a
    test's engine class from the wrong one."""
    seen: dict[str, str] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        other = seen.setdefault(path.name, str(path.relative_to(ROOT)))
        if other != str(path.relative_to(ROOT)):
            clashes.append((other, str(path.relative_to(ROOT))))
    assert not clashes, f"rename one of each pair: {clashes}"


def test_the_package_root_holds_only_entry_points():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ROOT_MODULES)
    assert not loose, f"modules at the package root belong in a package: {loose}"


# -- each rule fails on a planted violation ------------------------------------------------------
def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        if not (d / "__init__.py").exists():
            (d / "__init__.py").write_text("")
    return root


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    root = _plant(tmp_path, {"a.py": "def f():\n    from pkg import b\n",
                             "b.py": "from .a import f\n", "c.py": "import pkg.a\n"})
    assert cycles(import_graph(root)) == [["pkg.a", "pkg.b"]]


def test_a_circle_through_a_package_init_is_found(tmp_path):
    """config/__init__ imports config.schema, which imports models.x, which imports config.y:
    importing models.x first runs config/__init__ -> schema -> models.x half-initialized."""
    root = _plant(tmp_path, {"config/__init__.py": "from pkg.config.schema import S\n",
                             "config/schema.py": "from pkg.models.x import X\nS = 1\n",
                             "config/y.py": "Y = 1\n",
                             "models/x.py": "from pkg.config.y import Y\nX = 1\n"})
    assert cycles(import_graph(root)) == [["pkg.config", "pkg.config.schema", "pkg.models.x"]]
    # a sibling import inside the package runs no new __init__: no circle
    root = _plant(tmp_path / "ok", {"config/__init__.py": "from pkg.config.schema import S\n",
                                    "config/schema.py": "from pkg.config.y import Y\nS = 1\n",
                                    "config/y.py": "Y = 1\n"})
    assert cycles(import_graph(root)) == []


def test_a_product_import_of_testing_is_found(tmp_path):
    root = _plant(tmp_path, {"core.py": "def check():\n    from pkg.testing.verify import run\n",
                             "testing/verify.py": "from pkg.core import check\nrun = 1\n",
                             "testing/reference.py": "from pkg.testing import verify\n",
                             "cli/gpu.py": "from pkg.testing.verify import run\n",
                             "cli/plot.py": "from pkg.cli import gpu\n"})
    assert judges_imported_by(import_graph(root), "pkg") == [
        f"pkg.{m} -> pkg.testing{v}" for m in ("cli.gpu", "core") for v in ("", ".verify")]


ORDER_TEXT = """Some prose.

    order: fs < schedule < config, parallel < pipeline
           < checkpoint < __init__ < testing

More prose (order: is read once)."""


def test_the_stated_order_is_read():
    assert package_order(ORDER_TEXT) == [["fs"], ["schedule"], ["config", "parallel"],
                                         ["pipeline"], ["checkpoint"], ["__init__"], ["testing"]]
    assert package_order("no order here") == []


@pytest.mark.parametrize("source", [
    "from pkg.pipeline.engine import E\n",                                  # module level
    "def f():\n    import pkg.pipeline.engine\n",                           # in a function
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
    "    from pkg.pipeline import engine\n",                                 # TYPE_CHECKING
    "from ..pipeline.engine import E\n"])                                   # relative
def test_a_climbing_import_is_found(tmp_path, source):
    root = _plant(tmp_path, {"config/checks.py": source, "pipeline/engine.py": "E = 1\n",
                             "pipeline/weights.py": "from pkg.config import checks\n",
                             "fs.py": "import os\n", "__init__.py": "from pkg import fs\n"})
    order = package_order(ORDER_TEXT)
    found = climbing_imports(import_graph(root), order)
    assert found and all(f.startswith("pkg.config.checks -> pkg.pipeline") for f in found), found
    assert "pkg.config.checks -> pkg.pipeline.engine" in found
    # the same import turned around (pipeline -> config: down) and sideways (config -> parallel)
    root = _plant(tmp_path / "ok", {"config/checks.py": "from pkg.parallel import grid\n",
                                    "parallel/grid.py": "G = 1\n",
                                    "pipeline/weights.py": "from pkg.config import checks\n"})
    assert climbing_imports(import_graph(root), order) == []


def test_a_package_the_order_leaves_out_is_found(tmp_path):
    root = _plant(tmp_path, {"config/checks.py": "from pkg.extra import x\n",
                             "extra/x.py": "x = 1\n"})
    assert climbing_imports(import_graph(root), package_order(ORDER_TEXT)) == [
        "pkg.config.checks -> pkg.extra", "pkg.config.checks -> pkg.extra.x"]


def test_a_broken_must_not_import_is_found(tmp_path):
    root = _plant(tmp_path, {
        "schedule/__init__.py": '"""Owns: tables.\nMust not import: training, testing.\n"""\n',
        "schedule/tables.py": "def f():\n    import pkg.training.loop\n",
        "training/loop.py": "from pkg.schedule import tables\n"})
    assert forbidden(root)["pkg.schedule"] == ["training", "testing"]
    assert broken_promises(root) == ["pkg.schedule.tables imports pkg.training.loop: "
                                     "pkg.schedule must not import pkg.training"]


@pytest.mark.parametrize("source", ["import torch.nn as nn\n",
                                    "def f():\n    from torch import nn\n"])
def test_the_purity_rule_sees_torch(tmp_path, source):
    root = _plant(tmp_path, {"schedule/tables.py": source, "schedule/kinds.py": "import math\n"})
    assert len(torch_imports(root / "schedule")) == 1
