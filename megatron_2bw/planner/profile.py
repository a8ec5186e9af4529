"""Per-layer compute times: measured on this device, or analytic from FLOPs and a device model.

Both kinds answer `layer_times(cost, micro_batch, tensor) -> (forward_s, backward_s)` for one spec
of the model (`models/flops.LayerCost`), `step_time(params)` for a stage's per-batch local work
(gradient scaling, norm, optimizer step) and `data_time(micro_batch)` for reading one microbatch
(the first and the last stage each read it: inputs, labels). Profiles are JSON files users can
edit and share:

    {"source": "analytic", "device_tflops": 312, "efficiency": 0.5,
     "memory_bandwidth_gb_per_s": 2000, "step_bytes_per_param": 36}

    {"source": "measured", "device": "cpu, 1 thread", "dtype": "fp32",
     "model": {"hidden_size": 64, ...},
     "layers": {"transformer": {"4": {"forward_s": 0.0011, "backward_s": 0.0023}}, ...},
     "step_s_per_param": 2.1e-9, "data_s_per_sample": 2e-5}

A measured profile times each layer type the way a 1F1B pipeline runs it: the forward of one
microbatch, then the backward of the previous one, alternately (so caches are as cold as in the
engine, where a forward follows another microbatch's backward), and times the project's own
batch iterator on synthetic data of the model's shape for `data_s_per_sample`.

A measured profile holds one entry per micro-batch size it timed; other sizes are interpolated
linearly, and outside the measured range follow the GEMM-efficiency curve fitted to its own points
(`fit_gemm_curve`: t(b) = alpha + beta*b, i.e. efficiency M / (M + M_half) in the M = b*s rows of
the layer's GEMMs; alpha = 0, proportional scaling, when the points say so). Tensor parallelism
divides the measured single-rank times by t (the all-reduces are costed separately).

An analytic profile's compute rate is `device_tflops * efficiency * M / (M + gemm_half_tokens)`
for GEMMs of M = b*s rows (0: one efficiency for every b); under tensor parallelism the part of
the fixed cost beyond the weights' memory traffic is paid in full by every rank
(`curve.fixed_cost_split`; a measured profile's times are divided by t whole). `AnalyticProfile.for_device(name)`
gives the built-in V100, A100, H100 and H200 curves (`DEVICES`, each with its source).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from megatron_2bw.config.input_files import read_json
from megatron_2bw.config.numbers import is_finite
from megatron_2bw.fs import atomic_write_text
from megatron_2bw.models.flops import DTYPE_BYTES, LayerCost
from megatron_2bw.planner.curve import (DEVICES, fit_gemm_curve, fixed_cost_split,
                                        gemm_efficiency, ridge_tokens)
from megatron_2bw.planner.topology import PlanError
from megatron_2bw.schedule.compensation_methods import NONE as NO_COMPENSATION
from megatron_2bw.schedule.compensation_methods import compensation_method, method_names

STEP_BYTES = 36.0  # a plain step's memory traffic per parameter (AnalyticProfile's default)


def compensation_bytes(name: str, dtype: str) -> float:
    """Memory traffic per parameter a --2bw-compensation adds to a stage's step, elementwise
    once per batch (pipeline/compensation.py, "Time"): the prediction reads the master and
    Adam's two moments and writes the slot (12 bytes + the slot's dtype); the spike adds one
    pass over the gradient (4); the Nesterov form one pass over the kept gradient plus its copy
    (4 + 8). `none`: 0."""
    if name == NO_COMPENSATION:
        return 0.0
    method = compensation_method(name)
    extra = 12.0 + DTYPE_BYTES[dtype]
    if method.spikes:
        extra += 4.0
    if method.nesterov:
        extra += 12.0
    return extra

KINDS = ("embedding", "transformer", "head")
SHAPE_FIELDS = ("family", "hidden_size", "num_attention_heads", "ffn_size", "seq_length",
                "vocab_size", "max_positions", "untie_embeddings_and_output_weights",
                "position_embedding_type", "normalization", "swiglu", "query_groups",
                "add_bias_linear")


@dataclass
class AnalyticProfile:
    device_tflops: float = 312.0          # peak dense TFLOP/s of one accelerator (A100 bf16)
    efficiency: float = 0.5               # achievable fraction of the peak (the plateau)
    memory_bandwidth_gb_per_s: float = 2000.0
    step_bytes_per_param: float = 36.0    # memory traffic of scale + norm + Adam step, per param
    source: str = "analytic"
    gemm_half_tokens: float = 0.0         # GEMM rows at half the plateau (0: no curve)
    device: str = ""                      # a DEVICES name when built from one

    @classmethod
    def for_device(cls, name: str, **changes) -> "AnalyticProfile":
        key = name.lower()
        if key not in DEVICES:
            raise PlanError(f"unknown device {name!r}: use one of {', '.join(DEVICES)} (or "
                            "--device-tflops/--device-efficiency, or a measured --profile)")
        return cls(**dict(DEVICES[key], device=key, **changes)).validate()

    @classmethod
    def from_measured(cls, measured: "MeasuredProfile", model, **changes) -> "AnalyticProfile":
        """The analytic profile whose curve is the measured profile's own fit: the plateau rate
        and M_half from its transformer layer's (forward + backward) times."""
        from megatron_2bw.models.flops import layer_costs
        table = measured.layers["transformer"]
        alpha, beta = fit_gemm_curve([(b, f + g) for b, (f, g) in table.items()])
        per_sample = 3.0 * layer_costs(model, 1)[1].fwd_flops  # forward + backward FLOPs
        return cls(device_tflops=per_sample / beta / 1e12, efficiency=1.0,
                   gemm_half_tokens=alpha / beta * model.seq_length, **changes).validate()

    def validate(self) -> "AnalyticProfile":
        for name in ("device_tflops", "efficiency", "memory_bandwidth_gb_per_s",
                     "gemm_half_tokens"):
            if not is_finite(getattr(self, name)):
                raise PlanError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if not self.device_tflops > 0:
            raise PlanError(f"--device-tflops must be > 0, got {self.device_tflops}")
        if not 0 < self.efficiency <= 1:
            raise PlanError(f"--device-efficiency must be in (0, 1], got {self.efficiency}")
        if not self.memory_bandwidth_gb_per_s > 0:
            raise PlanError("memory_bandwidth_gb_per_s must be > 0, got "
                            f"{self.memory_bandwidth_gb_per_s}")
        if not self.gemm_half_tokens >= 0:
            raise PlanError(f"gemm_half_tokens must be >= 0, got {self.gemm_half_tokens}")
        return self

    def check_model(self, model, dtype: str) -> None:
        """Any model: times come from its FLOPs."""

    def layer_times(self, cost: LayerCost, micro_batch: int, tensor: int = 1,
                    tokens: float = 0.0) -> tuple:
        """`tokens`: the rows of the layer's GEMMs (b*s); 0 (unknown) runs at the plateau. With
        tensor parallelism the curve's fixed cost is split (`fixed_cost_split`): the part
        beyond the weights' memory traffic does not shrink with t."""
        half = fixed_cost_split(self.gemm_half_tokens, ridge_tokens(
            self.device_tflops, self.memory_bandwidth_gb_per_s), tensor)
        flops = self.device_tflops * 1e12 * self.efficiency * gemm_efficiency(tokens, half)
        bw = self.memory_bandwidth_gb_per_s * 1e9 * self.efficiency
        # what every tensor rank repeats (`LayerCost.replicated_bytes`) beyond its 1/t share
        repeated = cost.replicated_bytes * (1.0 - 1.0 / tensor) / bw
        fwd = max(cost.fwd_flops / flops, cost.fwd_bytes / bw) + repeated
        bwd = max(cost.bwd_flops / flops, 2.0 * cost.fwd_bytes / bw) + 2.0 * repeated
        return fwd, bwd

    def step_time(self, params: int) -> float:
        return params * self.step_bytes_per_param / (self.memory_bandwidth_gb_per_s * 1e9)

    def compensation_time(self, params: int, name: str, dtype: str) -> float:
        """The 2BW compensation's work per batch beyond the step (`compensation_bytes`)."""
        return params * compensation_bytes(name, dtype) / (self.memory_bandwidth_gb_per_s * 1e9)

    def data_time(self, micro_batch: int) -> float:
        """Accelerators read token ids prefetched by the host: nothing on the critical path."""
        return 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class MeasuredProfile:
    model: dict
    layers: dict                          # kind -> {micro batch: (forward_s, backward_s)}
    step_s_per_param: float
    dtype: str = "fp32"
    device: str = "cpu"
    data_s_per_sample: float = 0.0        # reading one sample of inputs and labels
    # --2bw-compensation name -> its work beyond the step, per parameter (measure_profile's
    # `compensation`); a method not measured is estimated from the step (`compensation_time`)
    compensation_s_per_param: dict = field(default_factory=dict)
    source: str = "measured"
    path: str = field(default="", repr=False)

    def validate(self) -> "MeasuredProfile":
        where = self.path or "profile"
        for kind in KINDS:
            table = self.layers.get(kind)
            if not table:
                raise PlanError(f"{where}: no timings for layer type {kind!r}: re-measure with "
                                "tools/plan.py --profile-out FILE")
            for b, (fwd, bwd) in table.items():
                if not (isinstance(b, int) and b >= 1 and is_finite(fwd) and is_finite(bwd)
                        and fwd >= 0 and bwd >= 0):
                    raise PlanError(f"{where}: bad entry for {kind} micro batch {b!r}: "
                                    "times must be >= 0 seconds")
        if not (is_finite(self.step_s_per_param) and self.step_s_per_param >= 0):
            raise PlanError(f"{where}: step_s_per_param must be a finite number >= 0")
        if not (is_finite(self.data_s_per_sample) and self.data_s_per_sample >= 0):
            raise PlanError(f"{where}: data_s_per_sample must be a finite number >= 0")
        for name, value in self.compensation_s_per_param.items():
            if name not in method_names() or not (is_finite(value) and value >= 0):
                raise PlanError(f"{where}: compensation_s_per_param[{name!r}] = {value!r}: give "
                                f"seconds >= 0 for one of {', '.join(method_names())}")
        return self

    def check_model(self, model, dtype: str) -> None:
        where = self.path or "the profile"
        for name in SHAPE_FIELDS:
            want, have = getattr(model, name, None), self.model.get(name)
            if have is not None and have != want:
                raise PlanError(f"{where} was measured for {name} {have}, not {want}: measure this "
                                "model with tools/plan.py --profile-out FILE (or use an analytic "
                                "profile)")
        if dtype != self.dtype:
            raise PlanError(f"{where} was measured in {self.dtype}, not {dtype}: re-measure with "
                            f"the same precision flag")

    def layer_times(self, cost: LayerCost, micro_batch: int, tensor: int = 1,
                    tokens: float = 0.0) -> tuple:
        table = self.layers[cost.name]
        return tuple(_interpolate(table, micro_batch, i) / tensor for i in (0, 1))

    def curve(self, kind: str = "transformer", i: int | None = None) -> tuple:
        """(alpha, beta) of this profile's own fit t(b) = alpha + beta*b (forward + backward,
        or the i-th time)."""
        table = self.layers[kind]
        return fit_gemm_curve([(b, sum(v) if i is None else v[i]) for b, v in table.items()])

    def step_time(self, params: int) -> float:
        return params * self.step_s_per_param

    def compensation_time(self, params: int, name: str, dtype: str) -> float:
        """The 2BW compensation's work per batch beyond the step: as measured, else the step's
        time per byte times the method's extra bytes (`compensation_bytes`; the step moves
        ~STEP_BYTES per parameter)."""
        if name in self.compensation_s_per_param:
            return params * self.compensation_s_per_param[name]
        return params * self.step_s_per_param * compensation_bytes(name, dtype) / STEP_BYTES

    def data_time(self, micro_batch: int) -> float:
        return micro_batch * self.data_s_per_sample

    def to_dict(self) -> dict:
        return {"source": self.source, "device": self.device, "dtype": self.dtype,
                "model": self.model, "step_s_per_param": self.step_s_per_param,
                "data_s_per_sample": self.data_s_per_sample,
                **({"compensation_s_per_param": dict(self.compensation_s_per_param)}
                   if self.compensation_s_per_param else {}),
                "layers": {k: {str(b): {"forward_s": f, "backward_s": g}
                               for b, (f, g) in sorted(v.items())}
                           for k, v in self.layers.items()}}


def _interpolate(table: dict, b: int, i: int) -> float:
    if b in table:
        return table[b][i]
    keys = sorted(table)
    if b < keys[0] or b > keys[-1]:  # the fitted curve, anchored at the nearest measured point
        end = keys[0] if b < keys[0] else keys[-1]
        alpha, beta = fit_gemm_curve([(k, table[k][i]) for k in keys])
        return table[end][i] * (alpha + beta * b) / (alpha + beta * end) if beta > 0 else 0.0
    hi = next(k for k in keys if k > b)
    lo = max(k for k in keys if k < b)
    w = (b - lo) / (hi - lo)
    return table[lo][i] * (1 - w) + table[hi][i] * w


def profile_from_dict(data: dict, path: str = "") -> AnalyticProfile | MeasuredProfile:
    where = path or "profile"
    if not isinstance(data, dict) or data.get("source") not in ("analytic", "measured"):
        raise PlanError(f"{where}: expected a JSON object with \"source\": \"analytic\" or "
                        "\"measured\"")
    try:
        if data["source"] == "analytic":
            known = {k: v for k, v in data.items() if k in AnalyticProfile.__dataclass_fields__}
            return AnalyticProfile(**known).validate()
        layers = {kind: {int(b): (float(e["forward_s"]), float(e["backward_s"]))
                         for b, e in table.items()} for kind, table in data["layers"].items()}
        return MeasuredProfile(dict(data.get("model", {})), layers, float(data["step_s_per_param"]),
                               data.get("dtype", "fp32"), data.get("device", "?"),
                               float(data.get("data_s_per_sample", 0.0)),
                               {str(k): float(v) for k, v in
                                data.get("compensation_s_per_param", {}).items()},
                               path=path).validate()
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, PlanError):
            raise
        raise PlanError(f"{where}: malformed profile ({type(e).__name__}: {e}): re-measure with "
                        "tools/plan.py --profile-out FILE") from None


def load_profile(path: str):
    fix = "give a profile JSON written by tools/plan.py --profile-out FILE"
    return profile_from_dict(read_json(path, fix, None, PlanError), path)


def save_profile(profile, path: str) -> None:
    atomic_write_text(path, json.dumps(profile.to_dict(), indent=2) + "\n")


# ---- measuring ---------------------------------------------------------------------------------


__all__ = ["AnalyticProfile", "MeasuredProfile", "load_profile", "save_profile",
           "profile_from_dict", "KINDS", "SHAPE_FIELDS", "compensation_bytes", "STEP_BYTES"]
