"""Every number is finite where a number is meant (config/numbers.py owns the rule).

- every console script of pyproject.toml's [project.scripts]: its parser (subparsers included)
  is captured as its `main` builds it, and every argument's type converter, as argparse
  resolves it, is fed nan / inf / -inf / 1e999: none may come back non-finite (a future
  `type=float` on a plain argparse parser fails here; the scanner is shown to catch one);
- the typed Config refuses NaN and inf in any float field, naming the flag (a programmatic or
  planner-made config goes through the same check as the flags);
- the issue's cases: --clip-grad nan, --exit-duration-in-mins nan, and NaN in the DeepSpeed JSON
  (tests/unit/test_deepspeed_types.py has the JSON's other numbers).
"""
from __future__ import annotations

import argparse
import importlib
import math
import signal
import tomllib
from pathlib import Path

import pytest

from megatron_2bw.config import Config, ConfigError
from megatron_2bw.config.numbers import FiniteParser, finite_float, nonfinite_fields

ROOT = Path(__file__).resolve().parents[2]
BAD = ("nan", "NaN", "inf", "-inf", "Infinity", "1e999")


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def console_parsers(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    """script name -> the parser its entry point builds (captured at its first parse)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    usr1 = signal.getsignal(signal.SIGUSR1)  # pretrain.main holds SIGUSR1 first
    out = {}
    try:
        for name, target in scripts.items():
            module, func = target.split(":")
            try:
                getattr(importlib.import_module(module), func)(["--help"])
            except _Captured as c:
                out[name] = c.parser
    finally:
        signal.signal(signal.SIGUSR1, usr1)
    assert set(out) == set(scripts), f"no parser captured for {set(scripts) - set(out)}"
    return out


def all_parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def _nonfinite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(_nonfinite(v) for v in value)
    return False


def bypasses(parser) -> tuple[list[str], int]:
    """(flags whose converter lets a non-finite number through, number of numeric flags)."""
    bad, numeric = [], 0
    for p in all_parsers(parser):
        for action in p._actions:
            if action.type is None or not action.option_strings:
                continue
            convert = p._registry_get("type", action.type, action.type)
            try:
                numeric += isinstance(convert("1.5"), float)
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                pass
            for text in BAD:
                try:
                    value = convert(text)
                except (argparse.ArgumentTypeError, ValueError, TypeError):
                    continue
                if _nonfinite(value):
                    bad.append(f"{p.prog} {action.option_strings[0]} {text}")
                    break
    return bad, numeric


def test_no_float_flag_of_any_console_script_takes_nan_or_inf(monkeypatch):
    parsers = console_parsers(monkeypatch)
    found, total = [], 0
    for name, parser in parsers.items():
        bad, numeric = bypasses(parser)
        found += [f"{name}: {b}" for b in bad]
        total += numeric
        assert all(isinstance(p, FiniteParser) for p in all_parsers(parser)), name
    assert not found, "float flags that bypass config/numbers.py's finite_float: " + \
        ", ".join(found)
    assert total > 40  # the scan saw the float flags (pretrain's alone has more than 30)


def test_the_scan_catches_a_plain_float_flag():
    p = argparse.ArgumentParser(prog="new-tool")
    p.add_argument("--ratio", type=float)
    p.add_argument("--pair", type=lambda s: tuple(float(x) for x in s.split(",")))
    sub = p.add_subparsers().add_parser("go")
    sub.add_argument("--rate", type=float)
    bad, numeric = bypasses(p)
    assert {b.split()[-2] for b in bad} == {"--ratio", "--pair", "--rate"} and numeric == 2
    ours = FiniteParser(prog="ours")
    ours.add_argument("--ratio", type=float)
    ours.add_subparsers().add_parser("go").add_argument("--rate", type=float)
    assert bypasses(ours) == ([], 2)


@pytest.mark.parametrize("text", BAD)
def test_finite_float_refuses_what_is_not_finite(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number"):
        finite_float(text)
    assert finite_float(" 1e-3 ") == 1e-3
    with pytest.raises(ValueError):
        finite_float("abc")


@pytest.mark.parametrize("path,flag", [
    ("optimizer.clip_grad", "--clip-grad"), ("optimizer.lr", "--lr"),
    ("optimizer.weight_decay", "--weight-decay"), ("optimizer.adam_beta1", "--adam-beta1"),
    ("optimizer.adam_eps", "--adam-eps"), ("precision.loss_scale", "--loss-scale"),
    ("precision.initial_loss_scale", "--initial-loss-scale"),
    ("model.hidden_dropout", "--hidden-dropout"), ("model.init_method_std", "--init-method-std"),
    ("model.layernorm_epsilon", "--norm-epsilon"),
    ("parallel.timeout_minutes", "--distributed-timeout-minutes"),
    ("train.exit_duration_in_mins", "--exit-duration-in-mins"),
    ("train.straggler_threshold", "--straggler-threshold")])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_config_with_a_nonfinite_float_is_refused_naming_the_flag(path, flag, value):
    cfg = Config().replace(**{path: value})
    with pytest.raises(ConfigError) as e:
        cfg.validate(1)
    assert str(e.value) == f"{flag} must be a finite number, got {value}"


def test_every_float_field_of_the_config_is_checked():
    """A float field added to the Config is covered without being listed anywhere."""
    cfg = Config()
    floats = [(s, f) for s in ("model", "parallel", "optimizer", "precision", "train")
              for f, v in vars(getattr(cfg, s)).items() if isinstance(v, float)]
    assert len(floats) >= 20
    for section, field in floats:
        assert len(nonfinite_fields(cfg.replace(**{f"{section}.{field}": math.nan}))) == 1


@pytest.mark.parametrize("argv,flag", [(["--clip-grad", "nan"], "--clip-grad"),
                                       (["--exit-duration-in-mins", "nan"],
                                        "--exit-duration-in-mins"),
                                       (["--lr", "inf"], "--lr"),
                                       (["--weight-decay", "Infinity"], "--weight-decay"),
                                       (["--loss-scale", "nan", "--fp16"], "--loss-scale")])
def test_pretrain_refuses_nonfinite_flags_in_one_line(capsys, argv, flag):
    from megatron_2bw.pretrain import parse
    with pytest.raises(SystemExit) as e:
        parse("gpt", ["--mock-data", *argv])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert f"argument {flag}: must be a finite number, got '{argv[1]}'" in err[0]


@pytest.mark.parametrize("section,where", [
    ({"gradient_clipping": math.nan}, "gradient_clipping"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": math.inf}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, math.nan]}}},
     "optimizer.params.betas"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": math.nan}}},
     "scheduler.params.warmup_max_lr"),
    ({"fp16": {"enabled": True, "loss_scale": math.inf}}, "fp16.loss_scale")])
def test_nan_in_the_deepspeed_json_is_refused(tmp_path, section, where):
    """json.loads accepts NaN and Infinity: the JSON's numbers go through the same owner."""
    import json
    from megatron_2bw.config.ds_json import config_from_deepspeed
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2, **section}))  # NaN / Infinity literals
    assert "NaN" in path.read_text() or "Infinity" in path.read_text()
    with pytest.raises(ConfigError) as e:
        config_from_deepspeed(str(path), world_size=1, num_stages=1, num_layers=2)
    assert f"{where} must be a finite number" in str(e.value) and "\n" not in str(e.value)
