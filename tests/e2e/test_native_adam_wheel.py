"""`pip wheel .` carries the native kernel's C source (built on first use from the installed
package)."""
import subprocess
import sys
import zipfile
from pathlib import Path


def test_an_installed_package_carries_the_kernel_source(tmp_path):
    """`pip install .` (cluster users): the wheel holds native_adam.c, which is built on first
    use from the installed package."""
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(root), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path)], check=True,
                   capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    assert "megatron_2bw/optim/native_adam.c" in zipfile.ZipFile(wheel).namelist()
