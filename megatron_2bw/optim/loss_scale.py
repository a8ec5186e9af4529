"""fp16 loss scaling. The scale is a host float: the engine reads the global inf/nan flag once per
batch (the only host sync, fp16 only) and every rank takes the same decision."""
from __future__ import annotations

from megatron_2bw.config import PrecisionConfig


class ConstantLossScaler:
    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """Halve on overflow (after `hysteresis` overflows), double after `window` clean steps."""

    def __init__(self, initial: float, minimum: float, window: int, hysteresis: int):
        self.scale, self.minimum = float(initial), float(minimum)
        self.window, self.hysteresis = window, hysteresis
        self._clean, self._tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean = 0
            self._tracker -= 1
            if self._tracker <= 0:
                self.scale = max(self.scale / 2.0, self.minimum)
        else:
            self._clean += 1
            if self._clean >= self.window:
                self._clean, self._tracker = 0, self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean": self._clean, "tracker": self._tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean, self._tracker = int(state["clean"]), int(state["tracker"])


def make_loss_scaler(cfg: PrecisionConfig):
    if cfg.dtype != "fp16":
        return ConstantLossScaler(1.0)
    if cfg.loss_scale is not None:
        return ConstantLossScaler(cfg.loss_scale)
    return DynamicLossScaler(cfg.initial_loss_scale, cfg.min_loss_scale, cfg.loss_scale_window,
                             cfg.hysteresis)
