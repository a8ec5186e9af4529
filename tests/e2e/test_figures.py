"""The figures command (tools/make_figures.py): it writes the three PNGs the README shows, and
the committed ones in docs/img/ are there, readable, and shown by the README where its text
talks about them. The convergence runs use compare_convergence's --tiny model here (seconds);
docs/img/convergence.png was drawn with the default (the README's model)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("timelines", "convergence", "memory")


def _check_png(path: Path):
    from matplotlib.image import imread
    img = imread(str(path))
    height, width = img.shape[:2]
    assert width >= 800 and height >= 300 and width / height <= 6, (path, img.shape)
    assert img[..., :3].std() > 0.05, f"{path} is blank"


@pytest.mark.slow  # three convergence runs and three drawings: 25-40 s on 2 busy cores
def test_make_figures_writes_the_three_pngs(tmp_path):
    proc = subprocess.run([sys.executable, "tools/make_figures.py", "--out-dir", str(tmp_path),
                           "--tiny", "--convergence-iters", "10"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name in FIGURES:
        assert f"wrote {tmp_path / name}.png" in proc.stdout
        _check_png(tmp_path / f"{name}.png")


def test_a_missing_out_dir_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "tools/make_figures.py", "--out-dir",
                           str(tmp_path / "none"), "--only", "memory"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--out-dir" in proc.stderr.splitlines()[-1]


def test_the_committed_figures_are_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name in FIGURES:
        _check_png(ROOT / "docs" / "img" / f"{name}.png")
        assert re.search(rf"!\[[^\]]+\]\(docs/img/{name}\.png\)", readme), name
