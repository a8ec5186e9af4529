""".gitignore never hides the project's own source: no directory that holds a tracked file, and
no new file placed in one, matches an ignore rule (an unanchored `dist/` once matched
megatron_2bw/checkpoint/dist/, so a new module there was silently untracked)."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, text=True)


@pytest.fixture(scope="module")
def tracked_dirs() -> list[str]:
    files = _git("ls-files").stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    return sorted({str(Path(f).parent) + "/" for f in files if str(Path(f).parent) != "."})


def test_no_tracked_directory_matches_an_ignore_rule(tracked_dirs):
    under = [d for d in tracked_dirs if d.startswith(("megatron_2bw/", "tests/"))]
    assert len(under) > 20
    # --no-index: ask the rules, whatever is tracked; a new file in each directory, too
    probe = "\n".join(under + [os.path.join(d, "new_module.py") for d in under]) + "\n"
    hidden = _git("check-ignore", "--no-index", "--stdin", "-v", stdin=probe).stdout
    assert not hidden, "ignore rules hide source directories:\n" + hidden


def test_the_root_rules_are_anchored():
    rules = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    anywhere = {"__pycache__/", "*.pyc", "*.egg-info/", ".pytest_cache/"}
    assert [r for r in rules if r not in anywhere and not r.startswith("/")] == []
    # what the rules exist for is still ignored
    ignored = _git("check-ignore", "--no-index", "--stdin",
                   stdin="dist/x.whl\nbuild/lib/x.py\nwandb/run\n.venv/bin/python\n").stdout
    assert ignored.split() == ["dist/x.whl", "build/lib/x.py", "wandb/run", ".venv/bin/python"]
