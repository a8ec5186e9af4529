"""The type of every DeepSpeed JSON key the drop-in reads, checked before any section is read
(`typed_ds_json`, called by read.py's `load_ds_json`, so both front doors and the DeepSpeed
surface see checked values).

DeepSpeed 0.19.8 reads its keys two ways, and so does this module:

- through its pydantic models (fp16, bf16, zero_optimization with offload_optimizer and
  offload_param, the monitors tensorboard / wandb / csv_monitor / comet): pydantic's lax
  coercion applies, so `"initial_scale_power": "16"` is 16, `"enabled": "true"` or 1 is true,
  `"stage": 1.0` is 1, `"reduce_bucket_size": 5e8` is 500000000, and a key set to "auto" takes
  its default (DeepSpeedConfigModel drops it). These are accepted and converted here
  (`PD_BOOL`, `PD_INT`, `PD_FLOAT`, `PD_STR`; DeepSpeed's own validators added: fp16.loss_scale,
  loss_scale_window and min_loss_scale refuse a bool), and `"zero_optimization": true` is
  DeepSpeed's old form of stage 1;
- as they are (get_scalar_param, the optimizer's and scheduler's params passed to their
  constructors, the pipeline section): a string where a number belongs reaches arithmetic or a
  comparison and fails there, or silently means something else ("false" is truthy). These are
  refused here, a string holding a number by name: `"gradient_clipping": "1.0"` gives
  "gradient_clipping must be a number, got "1.0" (a string: DeepSpeed reads this key as it is;
  write 1.0 without quotes)".

A section of the wrong type is named with its shape ("fp16 must be an object such as
{"enabled": true}, got true"); NaN and infinities (json.loads accepts them) are refused where a
number is meant (config/numbers.py). Every problem of one JSON comes in one line. Keys this
table does not list are left to keys.py (known, ignored, refused or a typo).
tests/unit/test_deepspeed_types.py checks the coercions against DeepSpeed's own config classes.
"""
from __future__ import annotations

import json
import re

from megatron_2bw.config.numbers import NOT_FINITE, is_finite
from megatron_2bw.config.ds_json.setting import fail

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}
_INT_TEXT = re.compile(r"[+-]?[0-9]+(_[0-9]+)*(\.0+)?")


class _Wrong(Exception):
    """The value is not of the kind: the message says what it must be."""


def shown(value) -> str:
    """The value as the JSON wrote it (true, null, "1.0", NaN)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class Kind:
    """What a key holds: `what` for the message, `convert` (value -> value, raises _Wrong),
    `raw` when DeepSpeed reads the key as it is (then a numeric string gets the quotes hint),
    `nullable` when null is accepted (and means: not given)."""

    def __init__(self, what: str, convert, raw: bool = True, nullable: bool = False,
                 number: bool = False):
        self.what, self.convert, self.raw = what, convert, raw
        self.nullable, self.number = nullable, number

    def or_null(self) -> "Kind":
        return Kind(f"{self.what} or null", self.convert, self.raw, True, self.number)


def _check(ok):
    def convert(value):
        if not ok(value):
            raise _Wrong
        return value
    return convert


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pd_bool(value):
    if isinstance(value, bool):
        return value
    if _real(value) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise _Wrong


def _pd_int(value, bools: bool = True):
    if isinstance(value, bool):
        if not bools:
            raise _Wrong
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and is_finite(value) and value == int(value):
        return int(value)
    if isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
        return int(value.strip().split(".")[0].replace("_", ""))  # "16", " 1_000 ", "16.00"
    raise _Wrong


def _pd_float(value, bools: bool = True):
    if isinstance(value, bool) and not bools:
        raise _Wrong
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise _Wrong from None
    raise _Wrong


def _pair(value):
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_real, value)):
        return list(value)
    raise _Wrong


NUMBER = Kind("a number", _check(_real), number=True)
INTEGER = Kind("an integer", _check(lambda v: isinstance(v, int) and not isinstance(v, bool)),
               number=True)
BOOLEAN = Kind("true or false", _check(lambda v: isinstance(v, bool)))
STRING = Kind("a string", _check(lambda v: isinstance(v, str)))
PAIR = Kind("a list of two numbers [beta1, beta2]", _pair)
STAGES = Kind('"auto" or an integer',
              _check(lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool))),
              number=True)
PD_BOOL = Kind("true or false", _pd_bool, raw=False)
PD_INT = Kind("an integer", _pd_int, raw=False, number=True)
PD_INT_NO_BOOL = Kind("an integer", lambda v: _pd_int(v, bools=False), raw=False, number=True)
PD_FLOAT = Kind("a number", _pd_float, raw=False, number=True)
PD_FLOAT_NO_BOOL = Kind("a number", lambda v: _pd_float(v, bools=False), raw=False, number=True)
PD_STR = Kind("a string", _check(lambda v: isinstance(v, str)), raw=False)
DEVICE = Kind('"none", "cpu" or "nvme"', _check(lambda v: v in ("none", "cpu", "nvme")),
              raw=False)


class Section:
    """An object of keys: `keys` (name -> Kind or Section), `example` for the message,
    `pydantic` when DeepSpeed reads it through a pydantic model ("auto" values dropped),
    `old_bool` DeepSpeed's meaning of a bool in its place (None: refused)."""

    def __init__(self, keys: dict, example: str, pydantic: bool = False, nullable: bool = True,
                 old_bool=None):
        self.keys, self.example, self.pydantic = keys, example, pydantic
        self.nullable, self.old_bool = nullable, old_bool


_OFFLOAD = Section({"device": DEVICE}, '{"device": "none"}', nullable=True)
_MONITOR = {"enabled": PD_BOOL, "output_path": PD_STR, "job_name": PD_STR,
            "project": PD_STR.or_null(), "group": PD_STR.or_null(), "team": PD_STR.or_null()}
SCHEMA = Section({
    "train_batch_size": INTEGER, "train_micro_batch_size_per_gpu": INTEGER,
    "gradient_accumulation_steps": INTEGER, "gradient_clipping": NUMBER,
    "steps_per_print": INTEGER, "wall_clock_breakdown": BOOLEAN, "dataloader_drop_last": BOOLEAN,
    "prescale_gradients": BOOLEAN, "gradient_predivide_factor": NUMBER, "strict": BOOLEAN,
    "amp": Section({"enabled": BOOLEAN}, '{"enabled": false}',
                   old_bool=lambda on: {"enabled": on}),
    "fp16": Section({"enabled": PD_BOOL, "auto_cast": PD_BOOL, "loss_scale": PD_FLOAT_NO_BOOL,
                     "initial_scale_power": PD_INT, "loss_scale_window": PD_INT_NO_BOOL,
                     "hysteresis": PD_INT, "consecutive_hysteresis": PD_BOOL,
                     "min_loss_scale": PD_INT_NO_BOOL,
                     "fp16_master_weights_and_grads": PD_BOOL},
                    '{"enabled": true, "initial_scale_power": 16}', pydantic=True),
    "bf16": Section({k: PD_BOOL for k in ("enabled", "immediate_grad_update",
                                          "check_grad_overflow", "check_overflow",
                                          "bf16_master_weights_and_grads",
                                          "bf16_optimizer_states")},
                    '{"enabled": true}', pydantic=True),
    "zero_optimization": Section({"stage": PD_INT, "reduce_bucket_size": PD_INT,
                                  "overlap_comm": PD_BOOL.or_null(),
                                  "offload_optimizer": _OFFLOAD, "offload_param": _OFFLOAD},
                                 '{"stage": 1} (or true / false, DeepSpeed\'s old form)',
                                 pydantic=True, old_bool=lambda on: {"stage": int(on)}),
    "optimizer": Section({"type": STRING, "params": Section({
        **{k: NUMBER for k in ("lr", "eps", "weight_decay", "momentum", "dampening")},
        "betas": PAIR,
        **{k: BOOLEAN for k in ("bias_correction", "amsgrad", "adam_w_mode", "torch_adam",
                                "nesterov")}}, '{"lr": 0.001}')},
        '{"type": "AdamW", "params": {"lr": 0.001}}'),
    "scheduler": Section({"type": STRING, "params": Section({
        **{k: NUMBER for k in ("warmup_min_lr", "cos_min_ratio", "warmup_min_ratio")},
        "warmup_max_lr": NUMBER.or_null(), "warmup_type": STRING,
        **{k: INTEGER for k in ("warmup_num_steps", "total_num_steps",
                                "last_batch_iteration")}}, '{"warmup_num_steps": 100}')},
        '{"type": "WarmupLR", "params": {"warmup_num_steps": 100}}'),
    "pipeline": Section({"schedule": STRING, "activation_checkpoint_interval": INTEGER,
                         "stages": STAGES, "partition": STRING,
                         **{k: BOOLEAN for k in ("seed_layers", "pipe_partitioned",
                                                 "grad_partitioned", "use_reentrant")}},
                        '{"schedule": "2bw"}'),
    "activation_checkpointing": Section({
        **{k: BOOLEAN for k in ("partition_activations", "contiguous_memory_optimization",
                                "cpu_checkpointing", "synchronize_checkpoint_boundary",
                                "profile")},
        "number_checkpoints": INTEGER.or_null()}, '{"partition_activations": false}'),
    "tensorboard": Section(_MONITOR, '{"enabled": true, "output_path": "logs/"}'),
    "csv_monitor": Section(_MONITOR, '{"enabled": true, "output_path": "logs/"}'),
    "wandb": Section(_MONITOR, '{"enabled": true, "project": "my-project"}'),
    "comet": Section({"enabled": PD_BOOL, "samples_log_interval": PD_INT, "online":
                      PD_BOOL.or_null(), **{k: PD_STR.or_null() for k in (
                          "project", "workspace", "api_key", "experiment_name",
                          "experiment_key", "mode")}}, '{"enabled": true}'),
}, "{}", nullable=False)
SCHEMA.keys["bfloat16"] = SCHEMA.keys["bf16"]


def _problem(path: str, kind: Kind, value) -> str:
    """The line for `value` at `path`; a string holding a number the key takes is named as a
    string, with the unquoted number as the fix (only a fix this module accepts)."""
    hint = ""
    if kind.raw and kind.number and isinstance(value, str):
        try:
            number = json.loads(value.strip())
            if is_finite(kind.convert(number)):
                hint = (" (a string: DeepSpeed reads this key as it is; write "
                        f"{value.strip()} without quotes)")
        except (ValueError, _Wrong):
            pass
    return f"{path} must be {kind.what}, got {shown(value)}{hint}"


def _finite(path: str, value) -> str | None:
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, float) and not is_finite(v) for v in values):
        return f"{path} {NOT_FINITE}, got {shown(value)}"
    return None


def _typed(section: Section, obj: dict, where: str, problems: list) -> dict:
    out = {}
    for key, value in obj.items():
        path = f"{where}.{key}" if where else key
        spec = section.keys.get(key)
        if spec is None:
            out[key] = value
        elif section.pydantic and value == "auto":
            continue  # DeepSpeedConfigModel drops "auto": DeepSpeed's default applies
        elif isinstance(spec, Section):
            if value is None and spec.nullable:
                out[key] = None
            elif isinstance(value, bool) and spec.old_bool is not None:
                out[key] = spec.old_bool(value)
            elif not isinstance(value, dict):
                problems.append(f"{path} must be an object such as {spec.example}, got "
                                f"{shown(value)}")
            else:
                out[key] = _typed(spec, value, path, problems)
        elif value is None and spec.nullable:
            continue  # null: not given
        else:
            try:
                converted = spec.convert(value)
            except _Wrong:
                problems.append(_problem(path, spec, value))
                continue
            bad = _finite(path, converted) if spec.number or spec is PAIR else None
            if bad:
                problems.append(bad)
                continue
            out[key] = converted
    return out


def typed_ds_json(ds: dict) -> dict:
    """A copy of the DeepSpeed config `ds` whose keys hold the types the drop-in reads
    (converted where DeepSpeed's pydantic models convert); one-line ConfigError naming every
    key of the wrong type otherwise."""
    problems: list[str] = []
    out = _typed(SCHEMA, ds, "", problems)
    if problems:
        fail("DeepSpeed config: " + "; ".join(problems))
    return out
