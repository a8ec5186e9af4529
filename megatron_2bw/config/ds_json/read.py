"""Finding and reading the DeepSpeed config (dict, JSON/hjson path, or args.deepspeed_config) the
way deepspeed.initialize does."""
from __future__ import annotations

import json
import os

from megatron_2bw.config.ds_json.setting import fail
from megatron_2bw.config.ds_json.types import typed_ds_json
from megatron_2bw.config.input_files import file_error, json_kind, parse_json, read_text

FIX = "--deepspeed_config must be a DeepSpeed JSON object such as {\"train_batch_size\": 8}"


def load_ds_json(config=None, args=None, config_params=None) -> dict:
    """The DeepSpeed config as a dict, from `config` (dict or JSON path), `config_params` (dict)
    or `args.deepspeed_config` (path), the way deepspeed.initialize finds it."""
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and args is not None:
        from_args = getattr(args, "deepscale_config", None)
    given = [c for c in (config, config_params) if c is not None]
    if from_args is not None and given:
        fail("DeepSpeed config given twice (args.deepspeed_config and the config argument of "
             "initialize): pass only one")
    if len(given) == 2 and given[0] is not given[1]:
        fail("pass the DeepSpeed config as config= or config_params=, not both")
    source = given[0] if given else from_args
    if source is None:
        fail("no DeepSpeed config: pass config=<dict or json path> to initialize (or "
             "args.deepspeed_config)")
    if isinstance(source, dict):
        return typed_ds_json(source)
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            fail(f"DeepSpeed config file {str(source)!r} does not exist")
        text = read_text(source, FIX)
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            try:
                import hjson  # DeepSpeed reads configs with hjson (comments, trailing commas)
                data = hjson.loads(text)
            except Exception:  # noqa: BLE001 - report the JSON error, one line
                parse_json(source, text, FIX)
        if not isinstance(data, dict):
            raise file_error(source, f"{json_kind(data)} where a JSON object {{...}} belongs",
                             FIX)
        return typed_ds_json(data)
    fail(f"DeepSpeed config must be a dict or a path, got {type(source).__name__}")
