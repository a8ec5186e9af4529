"""The 2BW staleness compensation methods (`--2bw-compensation`) as data: each method's name and
what it needs (the optimizers it is defined for, SGD's momentum buffer, weights kept apart from
the slots, a kept gradient), the fp32 copy of the weights a run keeps (`keeps_master`), and the
one-line refusal of a method that does not apply to a schedule and optimizer
(`compensation_error`). Pure: no torch; the config's checks, the planner and the engine ask it.
What each method computes and how the engine runs it: pipeline/compensation.py.
"""
from __future__ import annotations

from megatron_2bw.schedule.kinds import schedule_kind, schedule_names

NONE = "none"


class Method:
    name = NONE
    predicts = False      # the slot of batch t+2 gets a prediction of W(t+2), not W(t+1)
    spikes = False        # the step adds the spike correction
    optimizers = ("adam", "sgd")
    needs_momentum = False  # SGD: the method reads the momentum buffer
    nesterov = False      # the prediction takes the latest gradient for the next one

    @property
    def separate_weights(self) -> bool:
        """The slots do not hold the real weights: fp32 runs keep them in one more buffer."""
        return self.predicts

    @property
    def keeps_grad(self) -> bool:
        """The optimizer keeps its latest gradient (one more stage-sized fp32 buffer)."""
        return self.nesterov


class Predict(Method):
    name = "predict"
    predicts = True
    needs_momentum = True


class PredictSpike(Predict):
    name = "predict-spike"
    spikes = True
    optimizers = ("adam",)


class PredictNesterov(Predict):
    name = "predict-nesterov"
    nesterov = True
    optimizers = ("adam",)


_METHODS = {m.name: m for m in (Method(), Predict(), PredictSpike(), PredictNesterov())}


def method_names() -> tuple:
    return tuple(_METHODS)


def compensation_method(name: str) -> Method:
    method = _METHODS.get(name)
    if method is None:
        raise ValueError(f"unknown --2bw-compensation {name!r}: use one of "
                         f"{', '.join(method_names())}")
    return method


def keeps_master(dtype: str, name: str = NONE) -> bool:
    """An fp32 copy of the weights beside the slots: low precision, or slots that hold something
    else than the weights (a prediction)."""
    return dtype != "fp32" or compensation_method(name).separate_weights


def compensation_error(name: str, schedule: str, optimizer: str, sgd_momentum: float
                       ) -> str | None:
    """A one-line error when `name` does not apply to this schedule and optimizer, else None."""
    if name not in _METHODS:
        return f"unknown --2bw-compensation {name!r}: use one of {', '.join(method_names())}"
    method = _METHODS[name]
    if not method.predicts and not method.spikes:
        return None
    kind = schedule_kind(schedule)
    if kind.delay != 1:
        stale = [n for n in schedule_names() if schedule_kind(n).delay == 1]
        return (f"--2bw-compensation {name} compensates one-step-stale weights, which "
                f"--pipeline-schedule {kind.name} does not have: use --pipeline-schedule "
                f"{' or '.join(stale)}, or drop --2bw-compensation")
    if optimizer not in method.optimizers:
        return (f"--2bw-compensation {name} is defined for --optimizer "
                f"{' or '.join(method.optimizers)}, not {optimizer}: use --2bw-compensation "
                "predict")
    if optimizer == "sgd" and method.needs_momentum and not sgd_momentum:
        return (f"--2bw-compensation {name} with SGD predicts from the momentum buffer: set "
                "--sgd-momentum > 0 (or use --optimizer adam)")
    return None


__all__ = ["NONE", "Method", "Predict", "PredictSpike", "PredictNesterov", "method_names",
           "compensation_method", "keeps_master", "compensation_error"]
