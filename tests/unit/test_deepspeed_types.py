"""DeepSpeed JSON values are typed (config/ds_json/types.py), decided from DeepSpeed's own config:

- in the sections DeepSpeed reads through its pydantic models (fp16, bf16, zero_optimization,
  the monitors) each value is accepted exactly when the real DeepSpeedConfig accepts it, and
  converted to the value DeepSpeed's model holds ("16" -> 16, "true" -> true, 1.0 -> stage 1,
  "auto" -> the default, `"zero_optimization": true` -> stage 1), both directions;
- a key DeepSpeed reads as it is keeps a string as a string there (its config object holds
  "1.0"), so a string holding a number is refused here, by name, with the fix;
- the issue's five wrong types ("fp16": true, "zero_optimization": "1", "offload_optimizer":
  "cpu", "initial_scale_power": "16.5"-like values, "betas": 0.9) are one line from
  pretrain --deepspeed_config and from the drop-in's deepspeed.initialize, before any process
  group; a JSON string where a number belongs is not a conflict between "8" and 8.
"""
from __future__ import annotations

import json
import logging

import pytest
from torch import nn

from megatron_2bw.config import ConfigError
from megatron_2bw.config.ds_json import config_from_deepspeed, merge_flags_and_ds_config
from megatron_2bw.config.ds_json.types import typed_ds_json
from megatron_2bw.deepspeed.pipe import LayerSpec, PipelineModule
import megatron_2bw as deepspeed

from test_deepspeed_config import deepspeed_module, one_line_error  # noqa: E402

BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8}
# (section, key, value) in the pydantic sections; the other keys make the model check the key
COERCED = [
    ("fp16", "enabled", v) for v in (True, "true", "TRUE", "on", "yes", 1, 0, 1.0, "0", "off",
                                     "maybe", 2, " true", "auto")
] + [
    ("fp16", "initial_scale_power", v) for v in ("16", " 16 ", "16.0", 16.0, 12, "1_6", 16.5,
                                                 "16.5", "1e1", "x", True, "auto")
] + [
    ("fp16", "loss_scale", v) for v in ("128", 128, 0.5, "1e3", True, "nan", "inf", "big")
] + [
    ("fp16", k, v) for k in ("loss_scale_window", "min_loss_scale")
    for v in ("1000", 1000.0, True, 0.5, "x")
] + [
    ("fp16", "hysteresis", v) for v in ("2", 2.5, "two")
] + [
    ("bf16", "enabled", v) for v in ("yes", "nope", 1, None)
] + [
    ("zero_optimization", "stage", v) for v in ("1", 1.0, True, "one", 1.5, "0")
] + [
    ("zero_optimization", "reduce_bucket_size", v) for v in ("500000000", 5e8, 5.5, "5e8",
                                                             "1_000")
] + [
    ("zero_optimization", "overlap_comm", v) for v in ("true", 1, "x", None)
] + [
    ("tensorboard", "enabled", v) for v in ("true", "maybe")
] + [
    ("tensorboard", "output_path", v) for v in ("logs", 5)
]


def _deepspeed_verdict(ds: dict, section: str, key: str):
    """(accepted, the value DeepSpeed's config holds for section.key)."""
    config = deepspeed_module("deepspeed.runtime.config")
    logging.disable(logging.WARNING)
    try:
        c = config.DeepSpeedConfig(ds)
    except Exception:  # noqa: BLE001 - pydantic's ValidationError, TypeError, ...
        return False, None
    finally:
        logging.disable(logging.NOTSET)
    model = {"fp16": c.float16_config, "bf16": c.bfloat16_config,
             "zero_optimization": c.zero_config,
             "tensorboard": c.monitor_config.tensorboard}[section]
    value = getattr(model, key)
    return True, int(value) if key == "stage" else value


def _case(section, key, value) -> dict:
    body = {key: value}
    if section == "fp16" and key != "enabled":
        body["enabled"] = True
    if section == "zero_optimization" and key != "stage":
        body["stage"] = 1
    return {**BATCH, section: body}


@pytest.mark.parametrize("section,key,value", COERCED,
                         ids=[f"{s}.{k}={json.dumps(v)}" for s, k, v in COERCED])
def test_pydantic_sections_accept_and_convert_what_deepspeed_does(section, key, value):
    ds = _case(section, key, value)
    accepted, theirs = _deepspeed_verdict(ds, section, key)
    try:
        ours = typed_ds_json(ds)
    except ConfigError as e:
        assert not accepted, f"DeepSpeed takes {section}.{key}={value!r} as {theirs!r}: {e}"
        assert "\n" not in str(e) and f"{section}.{key} must be" in str(e), str(e)
        return
    assert accepted, f"DeepSpeed refuses {section}.{key}={value!r}, we take it"
    if value == "auto" or value is None:  # DeepSpeed's default: the key is left out here
        assert key not in ours[section]
    else:
        assert ours[section][key] == theirs and type(ours[section][key]) is type(theirs)


@pytest.mark.parametrize("zero,stage", [(True, 1), (False, 0)])
def test_zero_optimization_as_a_bool_is_deepspeeds_old_form(zero, stage):
    accepted, theirs = _deepspeed_verdict({**BATCH, "zero_optimization": zero},
                                          "zero_optimization", "stage")
    assert accepted and theirs == stage
    cfg, _ = config_from_deepspeed({**BATCH, "zero_optimization": zero}, world_size=1,
                                   num_stages=1, num_layers=2)
    assert cfg.parallel.distributed_optimizer is bool(stage)


@pytest.mark.parametrize("offload,ok", [({"device": "none"}, True), (None, True),
                                        ({"device": "gpu"}, False), ("cpu", False)])
def test_offload_sections(offload, ok):
    ds = {**BATCH, "zero_optimization": {"stage": 1, "offload_optimizer": offload}}
    assert _deepspeed_verdict(ds, "zero_optimization", "stage")[0] is ok
    if ok:
        config_from_deepspeed(ds, world_size=1, num_stages=1, num_layers=2)
    else:
        one_line_error(typed_ds_json, ds, match="zero_optimization.offload_optimizer")


# keys DeepSpeed reads as they are: (where in the JSON, value, DeepSpeedConfig's attribute)
RAW = [("gradient_clipping", "1.0", "gradient_clipping"),
       ("steps_per_print", "10", "steps_per_print"),
       ("gradient_predivide_factor", "1.0", "gradient_predivide_factor"),
       ("dataloader_drop_last", "yes", "dataloader_drop_last"),
       ("optimizer.params.lr", "1e-3", "optimizer_params"),
       ("optimizer.params.betas", 0.9, "optimizer_params"),
       ("scheduler.params.warmup_max_lr", "0.001", "scheduler_params"),
       ("pipeline.stages", "2", "pipeline")]


def _nested(path: str, value) -> dict:
    head, *rest = path.split(".")
    if not rest:
        return {head: value}
    body = _nested(".".join(rest), value)
    if head == "optimizer":
        body["type"] = "AdamW"
    if head == "scheduler":
        body["type"] = "WarmupLR"
    return {head: body}


@pytest.mark.parametrize("path,value,attr", RAW, ids=[r[0] for r in RAW])
def test_keys_deepspeed_reads_as_they_are_refuse_a_string(path, value, attr):
    ds = {**BATCH, **_nested(path, value)}
    config = deepspeed_module("deepspeed.runtime.config")
    logging.disable(logging.WARNING)
    try:
        held = getattr(config.DeepSpeedConfig(ds), attr)
    finally:
        logging.disable(logging.NOTSET)
    key = path.split(".")[-1]
    assert (held[key] if isinstance(held, dict) else held) == value  # unconverted there
    msg = one_line_error(typed_ds_json, ds, match=f"DeepSpeed config: {path} must be")
    if isinstance(value, str) and value[0].isdigit():
        assert f'got "{value}" (a string: DeepSpeed reads this key as it is; write {value} ' \
               "without quotes)" in msg
    fixed = {**BATCH, **_nested(path, json.loads(value) if isinstance(value, str) and
                                value[0].isdigit() else [0.9, 0.999] if key == "betas"
                                else True)}
    typed_ds_json(fixed)  # the suggested fix is accepted


def test_all_wrong_types_of_one_json_in_one_line():
    msg = one_line_error(typed_ds_json, {**BATCH, "fp16": True, "gradient_clipping": "1",
                                         "zero_optimization": {"stage": "x"}})
    assert msg.count(" must be ") == 3 and msg.startswith("DeepSpeed config: ")


ISSUE = [({"fp16": True}, 'fp16 must be an object such as {"enabled": true, '
                          '"initial_scale_power": 16}, got true'),
         ({"zero_optimization": "1"}, "zero_optimization must be an object such as "
                                      '{"stage": 1} (or true / false, DeepSpeed\'s old form), '
                                      'got "1"'),
         ({"zero_optimization": {"stage": 1, "offload_optimizer": "cpu"}},
          'zero_optimization.offload_optimizer must be an object such as {"device": "none"}, '
          'got "cpu"'),
         ({"fp16": {"enabled": True, "initial_scale_power": "sixteen"}},
          'fp16.initial_scale_power must be an integer, got "sixteen"'),
         ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}},
          "optimizer.params.betas must be a list of two numbers [beta1, beta2], got 0.9")]


@pytest.mark.parametrize("extra,line", ISSUE, ids=[next(iter(e)) for e, _ in ISSUE])
def test_wrong_types_are_one_line_from_pretrain(tmp_path, capsys, monkeypatch, extra, line):
    from megatron_2bw.pretrain import parse
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, **extra}))
    with pytest.raises(SystemExit) as e:
        parse("gpt", ["--mock-data", "--micro-batch-size", "8", "--deepspeed_config",
                      str(path)])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and err == [f"error: DeepSpeed config: {line}"], err


@pytest.mark.parametrize("extra,line", ISSUE, ids=[next(iter(e)) for e, _ in ISSUE])
def test_wrong_types_are_one_line_from_deepspeed_initialize(monkeypatch, extra, line):
    import torch.distributed as dist
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    net = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 2)], num_stages=1)
    msg = one_line_error(deepspeed.initialize, model=net, config={**BATCH, **extra})
    assert msg == f"DeepSpeed config: {line}"
    assert not dist.is_initialized()


def test_a_string_number_is_not_a_conflict_between_8_and_8():
    from megatron_2bw.config import Config
    cfg = Config().replace(batch={"micro_batch_size": 2, "global_batch_size": 8})
    msg = one_line_error(merge_flags_and_ds_config, cfg, {"--global-batch-size"},
                         {"train_batch_size": "8"}, world_size=1)
    assert "conflicts" not in msg
    assert msg == ('DeepSpeed config: train_batch_size must be an integer, got "8" (a string: '
                   "DeepSpeed reads this key as it is; write 8 without quotes)")
    merged, _ = merge_flags_and_ds_config(cfg, {"--global-batch-size"}, {"train_batch_size": 8},
                                          world_size=1)
    assert merged.batch.global_batch_size == 8


def test_coerced_values_reach_the_config():
    ds = {**BATCH, "fp16": {"enabled": "true", "initial_scale_power": "12",
                            "loss_scale_window": "500", "hysteresis": "3"},
          "zero_optimization": {"stage": "1", "overlap_comm": "false"}}
    cfg, _ = config_from_deepspeed(ds, world_size=1, num_stages=1, num_layers=2)
    p = cfg.precision
    assert (p.dtype, p.initial_loss_scale, p.loss_scale_window, p.hysteresis) == \
        ("fp16", 2.0 ** 12, 500, 3)
    assert cfg.parallel.distributed_optimizer and not cfg.parallel.overlap_grad_reduce
    cfg, _ = config_from_deepspeed({**BATCH, "fp16": {"enabled": "auto"}}, world_size=1,
                                   num_stages=1, num_layers=2)
    assert cfg.precision.dtype == "fp32"  # "auto": DeepSpeed's default, off


@pytest.mark.parametrize("key,value", [("gradient_clipping", "nan"), ("gradient_clipping", "inf"),
                                       ("train_batch_size", "8.5"),
                                       ("gradient_clipping", "1e999")])
def test_the_quotes_fix_is_offered_only_when_it_is_accepted(key, value):
    msg = one_line_error(typed_ds_json, {**BATCH, key: value}, match=f"{key} must be")
    assert "without quotes" not in msg
