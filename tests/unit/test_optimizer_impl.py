"""--optimizer-impl (issue 35): which kernel steps the flat optimizer. The default (auto) is torch's
kernels on every device, never the native C kernel; a named kernel travels flag -> Config
(OptimizerConfig.impl) -> the engine's optimizer; a bad or impossible choice is one line naming
the flag and the fix, from the config's checks before any process group (or, for what only the
device shows, from the optimizer)."""
import pytest
import torch

from megatron_2bw.config import Config, ConfigError, OptimizerConfig, ParallelConfig
from megatron_2bw.config import checks
from megatron_2bw.config.flags import config_from_args
from megatron_2bw.optim import kernels, native
from megatron_2bw.optim import optimizer as O
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pretrain import build_parser, parse
from megatron_2bw.training.build import build_engine

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "2", "--no-memory-check"]
FUSED = "torch-fused" if O._torch_fused_works(torch.device("cpu"), "adam") else "unfused"
HAS_NATIVE = native.library() is not None


def _cfg(argv) -> Config:
    return config_from_args(build_parser("gpt").parse_args([*TINY, *argv]), "gpt").validate(1)


def _one_line(e) -> str:
    msg = str(e.value)
    assert msg.strip() and "\n" not in msg and "\r" not in msg, repr(msg)
    return msg


# -- the default -----------------------------------------------------------------------------------
def test_the_default_on_a_cpu_is_torch_s_kernel_not_native(monkeypatch):
    cfg = _cfg([])
    assert cfg.optimizer.impl == "auto" == OptimizerConfig().impl
    for kind in ("adam", "sgd"):
        fused = "torch-fused" if O._torch_fused_works(torch.device("cpu"), kind) else "unfused"
        assert kernels.choose_impl("cpu", kind) == fused
        assert kernels.resolve_impl(None, kind, "cpu") == kernels.resolve_impl("auto", kind,
                                                                               "cpu") == fused
    engine = build_engine(cfg, ProcessGrid(1, 1, 1, rank=0), "cpu")
    assert engine.stepper.optimizer.impl == FUSED != "native"
    monkeypatch.setattr(kernels, "_torch_fused_works", lambda device, kind: False)
    assert kernels.choose_impl("cpu", "adam") == "unfused"  # the fallback, with or without cc


# -- flag -> config -> the engine's optimizer ------------------------------------------------------
@pytest.mark.parametrize("impl", ["native", "torch-fused", "unfused"])
def test_the_flag_reaches_the_engine_s_optimizer(impl):
    if impl == "native" and not HAS_NATIVE:
        pytest.skip("no C compiler to build the native kernel")
    if impl == "torch-fused" and FUSED != impl:
        pytest.skip("this torch has no fused CPU kernel")
    cfg = _cfg(["--optimizer-impl", impl])
    assert cfg.optimizer.impl == impl
    engine = build_engine(cfg, ProcessGrid(1, 1, 1, rank=0), "cpu")
    assert engine.stepper.optimizer.impl == impl
    assert O.make_optimizer(cfg.optimizer, 10, 5, "cpu").impl == impl
    assert O.make_optimizer(cfg.optimizer, 10, 5, "cpu", impl="unfused").impl == "unfused"


def test_sgd_takes_the_flag_too():
    cfg = _cfg(["--optimizer", "sgd", "--optimizer-impl", "unfused"])
    assert O.make_optimizer(cfg.optimizer, 10, 5, "cpu").impl == "unfused"


# -- bad and impossible choices: one line, before any process group --------------------------------
BAD = [  # (id, OptimizerConfig fields, ParallelConfig fields, words the line must hold)
    ("unknown", dict(impl="fast"), {}, ["unknown --optimizer-impl 'fast'", "auto, native"]),
    ("native-sgd", dict(impl="native", name="sgd"), {},
     ["--optimizer-impl native is an Adam kernel", "--optimizer sgd", "--optimizer-impl auto"]),
    ("apex-sgd", dict(impl="apex", name="sgd"), {},
     ["--optimizer-impl apex is an Adam kernel", "--optimizer-impl auto"]),
    ("native-nccl", dict(impl="native"), dict(backend="nccl"),
     ["--optimizer-impl native is a CPU kernel", "cuda", "--optimizer-impl auto"]),
]


@pytest.mark.parametrize("opt,par,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_choice_is_one_config_error(opt, par, words):
    with pytest.raises(ConfigError) as e:
        Config(optimizer=OptimizerConfig(**opt), parallel=ParallelConfig(**par)).validate(1)
    msg = _one_line(e)
    assert all(w in msg for w in words), msg


def test_native_without_a_c_compiler_is_refused_by_the_config(monkeypatch):
    monkeypatch.setattr(checks.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError) as e:
        Config(optimizer=OptimizerConfig(impl="native")).validate(1)
    assert _one_line(e) == checks.IMPL_MISSING["native"]
    assert "cc or gcc" in str(e.value) and "--optimizer-impl auto" in str(e.value)
    Config().validate(1)  # the default needs no compiler


@pytest.mark.skipif(kernels._apex_adam() is not None, reason="apex is installed here")
def test_apex_without_apex_is_refused_by_the_config():
    with pytest.raises(ConfigError) as e:
        Config(optimizer=OptimizerConfig(impl="apex")).validate(1)
    assert _one_line(e) == checks.IMPL_MISSING["apex"]


def test_what_only_the_device_shows_is_one_line_from_the_optimizer(monkeypatch):
    """A library that did not build, a non-CPU device, a torch without the fused kernel."""
    with pytest.raises(ConfigError, match="--optimizer-impl native is a CPU kernel") as e:
        kernels.resolve_impl("native", "adam", "meta")
    _one_line(e)
    monkeypatch.setattr(native, "library", lambda: None)
    with pytest.raises(ConfigError) as e:
        O.make_optimizer(OptimizerConfig(impl="native"), 10, 5, "cpu")
    assert _one_line(e) == checks.IMPL_MISSING["native"]
    monkeypatch.setattr(kernels, "_torch_fused_works", lambda device, kind: False)
    with pytest.raises(ConfigError, match="^--optimizer-impl torch-fused: this torch") as e:
        O.make_optimizer(OptimizerConfig(name="sgd"), 10, 5, "cpu", impl="torch-fused")
    assert "--optimizer-impl auto" in _one_line(e)


def test_the_command_line_stops_in_one_line_before_any_process_group(monkeypatch, capsys):
    """pretrain_gpt.py as rank 0 of two: argparse refuses an unknown name, the config's checks
    an impossible one; exit 2, one line on stderr, no process group."""
    import torch.distributed as dist
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    for argv, words in ((["--optimizer-impl", "fast"], ["--optimizer-impl", "invalid choice"]),
                        (["--optimizer", "sgd", "--optimizer-impl", "native"],
                         ["error: --optimizer-impl native is an Adam kernel"])):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            parse("gpt", [*TINY, "--global-batch-size", "8", *argv])
        assert e.value.code == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and all(w in lines[0] for w in words), lines
        assert not dist.is_initialized()
