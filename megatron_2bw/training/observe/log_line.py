"""Megatron-LM's console lines, written and read back: the interval line and the validation line.

Written with the format strings of Megatron-LM's megatron/training/training.py, `training_log`
(the interval line) and `evaluate_and_print_results` (the validation line), so a scraper written
for Megatron's SLURM logs reads ours:

     [2026-12-04 03:12:45.123456] iteration       10/      30 | consumed samples:          320 |
     elapsed time per iteration (ms): 136.2 | learning rate: 2.000000E-03 | global batch size:
        32 | lm loss: 7.481000E+00 | loss scale: 1.0 | grad norm: 0.622 | number of skipped
     iterations:   0 | number of nan iterations:   0 | ETA: 2s | samples/s: 235 | ...

(one line). Megatron's fields come in Megatron's order with its number formats (`MEGATRON`);
the optional ones appear where Megatron prints them: `throughput per GPU (TFLOP/s/GPU)` with
--log-throughput, `decoupled learning rate` with --decoupled-lr (Megatron-LM before 2025-11
printed it; its position here), `params norm` with --log-params-norm. `lm loss` is left out when
every iteration of the interval was a skipped fp16 step (Megatron prints its empty mean as 0).
Our fields follow Megatron's on the same line in the same ` key: value |` form (ETA, samples/s,
tokens/s, memory per stage, the 2BW compensation, the --wall-clock-breakdown and --log-straggler
fields): floats to 4 significant digits, per-stage lists in brackets, text as is.

The validation line is framed by dashes, as Megatron prints it:

    -----------------------------------------------------------------------------------------
     validation loss at iteration 15 | lm loss value: 7.123456E+00 | lm loss PPL: 1.239000E+03 |
    -----------------------------------------------------------------------------------------

(--skip-train's: `validation loss at iteration N on validation set`, Megatron's prefix for the
evaluation after training).

`parse_line` reads both these lines and the ones megatron-2bw printed before (`iteration 10/30 |
consumed samples 320 | ms/iteration 136.2 | lr 2.000e-03 | lm loss 7.481 | ...` and `iteration
15/30 | validation loss 7.12 | validation ppl 1239`), under the new names (`OLD_NAMES`).
"""
from __future__ import annotations

import re
from datetime import datetime

# Megatron's fields of the interval line, in its order, with its formats (training_log)
MEGATRON = {
    "consumed samples": "{:12d}",
    "elapsed time per iteration (ms)": "{:.1f}",
    "throughput per GPU (TFLOP/s/GPU)": "{:.1f}",
    "learning rate": "{:.6E}",
    "decoupled learning rate": "{:.6E}",
    "global batch size": "{:5d}",
    "lm loss": "{:.6E}",
    "loss scale": "{:.1f}",
    "grad norm": "{:.3f}",
    "params norm": "{:.3f}",
    "number of skipped iterations": "{:3d}",
    "number of nan iterations": "{:3d}",
}
INTEGERS = {"consumed samples", "global batch size", "number of skipped iterations",
            "number of nan iterations"}
# megatron-2bw's earlier names -> the names above (the old `skipped` counted the whole run's
# skipped steps, Megatron's field those of the interval)
OLD_NAMES = {"ms/iteration": "elapsed time per iteration (ms)", "lr": "learning rate",
             "decoupled lr": "decoupled learning rate", "skipped": "number of skipped iterations",
             "TFLOP/s/device": "throughput per GPU (TFLOP/s/GPU)",
             "validation loss": "lm loss value", "validation ppl": "lm loss PPL"}
TIMESTAMP = "%Y-%m-%d %H:%M:%S.%f"  # Megatron's (print_datetime and training_log)

_INTERVAL = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?iteration\s+(\d+)/\s*\d+ \|(.*)$")
_VALIDATION = re.compile(r"^\s*validation loss at iteration (\d+)(?: on validation set)? \|(.*)$")


def _extra(value) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(f"{v:.2f}" for v in value) + "]"
    return str(value)


def format_interval(iteration: int, train_iters: int, fields: dict,
                    now: datetime | None = None) -> str:
    """The interval line: Megatron's fields of `fields` in Megatron's order and formats, then
    the others in their order."""
    stamp = (now or datetime.now()).strftime(TIMESTAMP)
    line = f" [{stamp}]" + " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    for key, spec in MEGATRON.items():
        if key in fields:
            value = fields[key]
            value = int(value) if key in INTEGERS else float(value)
            line += f" {key}: {spec.format(value)} |"
    for key, value in fields.items():
        if key not in MEGATRON:
            line += f" {key}: {_extra(value)} |"
    return line


def validation_lines(iteration: int, loss: float, ppl: float,
                     on_validation_set: bool = False) -> list[str]:
    """The validation line between its two dashed lines (`on_validation_set`: Megatron's prefix
    of the evaluation after training, here --skip-train's)."""
    prefix = f"iteration {iteration}" + (" on validation set" if on_validation_set else "")
    string = f" validation loss at {prefix} | "
    string += "{} value: {:.6E} | ".format("lm loss", loss)
    string += "{} PPL: {:.6E} | ".format("lm loss", ppl)
    dashes = "-" * (len(string) + 1)
    return [dashes, string, dashes]


def parse_line(line: str) -> tuple[int, dict] | None:
    """(iteration, {name: value}) of an interval or validation line, Megatron's or ours, new or
    old (old names as `OLD_NAMES` renames them); numbers as floats, per-stage lists as lists of
    floats, anything else as text. A validation line's fields are `lm loss value` and `lm loss
    PPL`. None for any other line."""
    m = _VALIDATION.match(line) or _INTERVAL.match(line)
    if not m:
        return None
    fields = {}
    for part in m.group(2).split("|"):
        part = part.strip()
        if not part:
            continue
        if ": " in part:  # no name holds ": "
            key, value = part.split(": ", 1)
        else:  # our earlier `key value` form
            kv = re.match(r"(.*?) (\[.*\]|\S+)$", part)
            if not kv:
                continue
            key, value = kv.groups()
        fields[OLD_NAMES.get(key.strip(), key.strip())] = _value(value.strip())
    return int(m.group(1)), fields


def _value(text: str):
    if text.startswith("["):
        return [float(x) for x in text.strip("[]").split(",") if x.strip()]
    try:
        return float(text)
    except ValueError:
        return text
