"""The names DeepSpeed scripts import, without processes: the opt-in `deepspeed` alias and its
`from deepspeed.x import y` forms, attribute access through `import megatron_2bw as deepspeed`,
runtime.utils, the accelerator views, deepspeed.checkpointing, the version, and the README's
table of which names exist (checked against the code)."""
import importlib
import importlib.metadata
import random
import re
import sys
from pathlib import Path

import numpy
import pytest
import torch

import megatron_2bw
from megatron_2bw.config import ConfigError
from megatron_2bw.deepspeed import accelerator as acc
from megatron_2bw.deepspeed import checkpointing
from megatron_2bw.deepspeed.runtime import utils as rutils

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_deepspeed(monkeypatch):
    """sys.modules and sys.meta_path as a process that never imported any `deepspeed` sees
    them, restored afterwards (the real DeepSpeed other tests import comes back)."""
    saved = {k: v for k, v in sys.modules.items()
             if k == "deepspeed" or k.startswith("deepspeed.")
             or k == "megatron_2bw.deepspeed.alias"}
    for k in saved:
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield
    for k in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
        del sys.modules[k]
    sys.modules.pop("megatron_2bw.deepspeed.alias", None)
    sys.modules.update(saved)


def test_alias_makes_from_deepspeed_imports_the_drop_in(no_deepspeed):
    deepspeed = importlib.import_module("megatron_2bw.deepspeed.alias")
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.schedule import TrainSchedule
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid
    from deepspeed.runtime.utils import set_random_seed
    from deepspeed.utils import RepeatingLoader, log_dist
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.checkpointing import checkpoint
    assert sys.modules["deepspeed"] is deepspeed
    assert PipelineModule is megatron_2bw.pipe.PipelineModule
    assert TrainSchedule.__module__ == "megatron_2bw.deepspeed.runtime.pipe.schedule"
    assert PipelineParallelGrid.__module__ == "megatron_2bw.deepspeed.runtime.pipe.topology"
    assert set_random_seed is rutils.set_random_seed and checkpoint is checkpointing.checkpoint
    assert RepeatingLoader.__module__ == log_dist.__module__ == "megatron_2bw.deepspeed.utils"
    assert dist.get_rank() == 0 and get_accelerator() is acc.get_accelerator()
    assert deepspeed.initialize is megatron_2bw.initialize
    assert deepspeed.__version__ == megatron_2bw.__version__
    # the target module is itself, not a copy: its spec still names its own place
    assert sys.modules["deepspeed.pipe"].__spec__.name == "megatron_2bw.deepspeed.pipe"
    with pytest.raises(ModuleNotFoundError, match="deepspeed.ops.*in the megatron_2bw"):
        importlib.import_module("deepspeed.ops.adam")


def test_alias_is_refused_when_the_real_deepspeed_is_imported(no_deepspeed):
    sys.modules["deepspeed"] = type(sys)("deepspeed")   # what `import deepspeed` left behind
    with pytest.raises(ConfigError) as e:
        importlib.import_module("megatron_2bw.deepspeed.alias")
    assert "\n" not in str(e.value) and "already imported" in str(e.value)


def test_attribute_access_through_the_root():
    ds = megatron_2bw
    assert ds.runtime.utils.set_random_seed is rutils.set_random_seed
    assert ds.runtime.pipe.schedule.InferenceSchedule(2, 2, 0).num_pipe_buffers() == 2
    assert ds.runtime.pipe.topology.PipelineParallelGrid.__name__ == "PipelineParallelGrid"
    assert ds.runtime.pipe.PipelineModule is ds.pipe.PipelineModule
    assert ds.accelerator.get_accelerator().device_name() in ("cpu", "cuda")
    assert ds.checkpointing.is_configured() in (True, False)
    assert ds.comm.get_world_size() == 1 and ds.utils.logger.name == "DeepSpeed"
    with pytest.raises(AttributeError):
        ds.runtime.engine


def test_version_is_the_deepspeed_release_the_api_follows():
    assert re.fullmatch(r"\d+\.\d+\.\d+", megatron_2bw.__version__)
    try:
        installed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("deepspeed not installed: no check that the version is the one tested")
    assert megatron_2bw.__version__ == installed


def _draws():
    return random.random(), float(numpy.random.rand()), float(torch.rand(()))


def test_set_random_seed_seeds_python_numpy_and_torch_as_deepspeed_does():
    rutils.set_random_seed(2 ** 40 + 7)    # numpy takes it mod 2**32, as DeepSpeed's does
    first = _draws()
    rutils.set_random_seed(2 ** 40 + 7)
    assert _draws() == first
    rutils.set_random_seed(8)
    assert _draws() != first
    real = pytest.importorskip("deepspeed.runtime.utils")
    real.set_random_seed(2 ** 40 + 7)
    assert _draws() == first


def test_runtime_utils_helpers():
    assert rutils.call_to_str("F", 1, buffer_id=2) == "F(1, buffer_id=2)"
    assert rutils.get_only_unique_item([3, 3]) == 3
    with pytest.raises(RuntimeError):
        rutils.get_only_unique_item([3, 4])
    moved = rutils.move_to_device({"a": [torch.ones(1)], "b": (torch.zeros(2),)}, "cpu")
    assert moved["a"][0].device.type == "cpu" and isinstance(moved["b"], tuple)
    assert rutils.partition_uniform(5, 2) == [0, 3, 5]


def test_accelerator_views_for_cpu_and_cuda(monkeypatch):
    cpu, cuda = acc.Accelerator("cpu"), acc.Accelerator("cuda")
    assert (cpu.device_name(), cpu.device_name(1), cpu.communication_backend_name()) == \
        ("cpu", "cpu", "gloo")
    assert (cuda.device_name(), cuda.device_name(1), cuda.communication_backend_name()) == \
        ("cuda", "cuda:1", "nccl")
    assert cpu.device() == torch.device("cpu") and cpu.is_available()
    assert cpu.on_accelerator(torch.ones(1)) and not cuda.on_accelerator(torch.ones(1))
    assert 0 < cpu.available_memory() <= cpu.total_memory() and cpu.memory_allocated() > 0
    cpu.manual_seed(3)
    a = torch.rand(2)
    cpu.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    monkeypatch.setattr(acc, "_CURRENT", {})
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert acc.get_accelerator()._name == want
    monkeypatch.setattr(acc, "_CURRENT", {})
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert acc.get_accelerator().device_name() == "cpu"
    monkeypatch.setattr(acc, "_CURRENT", {})
    monkeypatch.setenv("DS_ACCELERATOR", "hpu")
    with pytest.raises(ConfigError, match="DS_ACCELERATOR='hpu'"):
        acc.get_accelerator()
    with pytest.raises(ConfigError):
        acc.Accelerator("xpu")


def test_checkpointing_configure_and_checkpoint(caplog):
    checkpointing.reset()
    assert not checkpointing.is_configured()
    checkpointing.configure(None, deepspeed_config={
        "activation_checkpointing": {"partition_activations": True, "number_checkpoints": 2}})
    assert checkpointing.is_configured()
    warned = [r.getMessage() for r in caplog.records if r.name == "DeepSpeed"]
    assert len(warned) == 1 and "partition_activations only moves saved activations" in warned[0]
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    torch.manual_seed(0)
    plain = layer(x)
    plain.sum().backward()
    g_plain = x.grad.clone()
    x.grad = None
    torch.manual_seed(0)
    again = checkpointing.checkpoint(layer, x)
    again.sum().backward()
    assert torch.equal(plain, again) and torch.equal(g_plain, x.grad)  # same dropout mask
    caplog.clear()
    checkpointing.configure(None, deepspeed_config={
        "activation_checkpointing": {"cpu_checkpoint": True}})
    (line,) = [r.getMessage() for r in caplog.records if r.name == "DeepSpeed"]
    assert "did you mean 'cpu_checkpointing'" in line    # DeepSpeed ignores it: a warning
    with pytest.raises(ConfigError, match="did you mean 'cpu_checkpointing'"):
        checkpointing.configure(None, deepspeed_config={
            "activation_checkpointing": {"cpu_checkpoint": True}, "strict": True})
    checkpointing.reset()
    assert not checkpointing.is_configured()
    tracker = checkpointing.model_parallel_cuda_manual_seed(5)
    assert checkpointing.get_cuda_rng_tracker() is tracker


# -- the README's table ---------------------------------------------------------------------------

def _table():
    text = (ROOT / "README.md").read_text()
    section = text.split("## DeepSpeed pipeline scripts", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 15, "the names table of the README's DeepSpeed section"
    out = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            out.append((name, cells[1]))
    return out


def _exists(name: str) -> bool:
    from megatron_2bw.deepspeed import DeepSpeedPipelineEngine
    name = name.removesuffix("()")
    if name.startswith("engine."):   # a method or property, or an attribute __init__ sets
        attr = name.split(".", 1)[1]
        source = (ROOT / "megatron_2bw" / "deepspeed" / "engine.py").read_text()
        return hasattr(DeepSpeedPipelineEngine, attr) or \
            re.search(rf"self\.{attr}\s*=", source) is not None
    obj = megatron_2bw
    for part in name.split(".")[1:]:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            return False
    return True


def test_readme_table_says_which_names_exist():
    table = _table()
    wrong = [(n, said) for n, said in table if (said == "yes") != _exists(n)]
    assert not wrong, f"README says, code disagrees: {wrong}"
    assert {s for _, s in table} <= {"yes", "no"}
    from megatron_2bw.deepspeed.names import NAMES
    listed = {n for n, said in table if said == "yes"}
    missing = [f"deepspeed.{m}" for m in NAMES if f"deepspeed.{m}" not in listed]
    assert not missing, f"alias modules missing from the README table: {missing}"
