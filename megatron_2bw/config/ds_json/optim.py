"""The DeepSpeed "optimizer" section (Adam, AdamW, SGD) as Settings of Config.optimizer."""
from __future__ import annotations

from megatron_2bw.config.ds_json.keys import unknown_key
from megatron_2bw.config.ds_json.setting import Setting, fail

_ADAM_IGNORED = ("torch_adam", "adam_w_mode", "foreach", "fused", "fp32_optimizer_states",
                 "capturable", "differentiable", "set_grad_none")
_SGD_IGNORED = ("foreach", "maximize", "differentiable", "fused")
_KNOWN = {"adam": ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad",
                   "max_grad_norm") + _ADAM_IGNORED,
          "sgd": ("lr", "momentum", "weight_decay", "nesterov", "dampening") + _SGD_IGNORED}


def optimizer_settings(ds: dict) -> list[Setting]:
    opt = ds.get("optimizer")
    if opt is None:
        return []
    if not isinstance(opt, dict) or "type" not in opt:
        fail('DeepSpeed config: "optimizer" needs a "type" (Adam, AdamW or SGD) and "params"')
    kind, params = str(opt["type"]), dict(opt.get("params") or {})
    if "max_grad_norm" in params:
        fail("DeepSpeed config: 'max_grad_norm' is not an optimizer parameter: use the "
             "top-level 'gradient_clipping'")
    out = []

    def take(name, path, flag, default):
        explicit = name in params
        value = params.pop(name, default)
        out.append(Setting(f"optimizer.params.{name}", flag, path, value, explicit))
        return value

    if kind.lower() in ("adam", "adamw"):
        w_mode = kind.lower() == "adamw" or params.get("adam_w_mode", True)
        torch_adam = params.get("torch_adam", False)
        out.append(Setting("optimizer.type", "--optimizer", "optimizer.name", "adam"))
        take("lr", "optimizer.lr", "--lr", 1e-3)
        betas = params.pop("betas", None)
        b = list(betas) if betas is not None else [0.9, 0.999]
        if len(b) != 2:
            fail(f"DeepSpeed config: optimizer.params.betas must hold two numbers, got {betas}")
        for i in (1, 2):
            out.append(Setting("optimizer.params.betas", f"--adam-beta{i}",
                               f"optimizer.adam_beta{i}", float(b[i - 1]), betas is not None))
        take("eps", "optimizer.adam_eps", "--adam-eps", 1e-8)
        # FusedAdam (DeepSpeed's default) decays 0 by default; torch.optim.AdamW 0.01
        wd = take("weight_decay", "optimizer.weight_decay", "--weight-decay",
                  0.01 if torch_adam and w_mode else 0.0)
        if not w_mode and wd:
            fail("DeepSpeed config: Adam with adam_w_mode false (L2 weight decay) is not "
                 "supported: use AdamW-style decay (adam_w_mode true) or weight_decay 0")
        if not params.pop("bias_correction", True) or params.pop("amsgrad", False):
            fail("DeepSpeed config: bias_correction false / amsgrad true are not supported")
        for k in _ADAM_IGNORED:
            params.pop(k, None)
    elif kind.lower() == "sgd":
        out.append(Setting("optimizer.type", "--optimizer", "optimizer.name", "sgd"))
        take("lr", "optimizer.lr", "--lr", 1e-3)
        take("momentum", "optimizer.sgd_momentum", "--sgd-momentum", 0.0)
        take("weight_decay", "optimizer.weight_decay", "--weight-decay", 0.0)
        if params.pop("nesterov", False) or params.pop("dampening", 0):
            fail("DeepSpeed config: SGD nesterov / dampening are not supported")
        for k in _SGD_IGNORED:
            params.pop(k, None)
    else:
        fail(f"DeepSpeed config: optimizer type {kind!r} is not supported: use Adam, AdamW or "
             "SGD")
    if params:
        family = "sgd" if kind.lower() == "sgd" else "adam"
        unknown_key(sorted(params)[0], _KNOWN[family], f"optimizer.params ({kind})")
    return out
