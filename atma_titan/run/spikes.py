"""Loss and gradient-norm spikes: a rolling robust z-score of each against the recent steps, and its verdict.

A step spikes when its loss or its gradient norm lies more than `spikes.loss_z` / `spikes.grad_z` robust
standard deviations above the median of the last `spikes.window` accepted steps (the spread is 1.4826 x the
median absolute deviation, floored at 0.1% of the median so that a flat stretch does not make every wiggle a
spike). Nothing is judged before `spikes.warmup` steps are in the window, and a spiking or non-finite step
never enters it. The policy (`spikes.policy`) says what a spike does: `log` only says so, `skip` leaves the
weights as they were (no update, as training.nan_policy = 'skip' does for a NaN), `stop` stops the run so it
can be rolled back (checkpoint.load_step) past the data that caused it (data.skip).

The test runs twice per step and must agree: on the device, where the optimizers that decide there (Muon, a
fused AdamW) read the skip flag before the host has the step's values, and on the host, which logs and
records. Both compare the float32 loss and norm with the same float32 thresholds (`thresholds()`), computed
before the step, so they cannot disagree. The window is checkpointed (a DCP Stateful, "spike_monitor"), so a
resumed run judges its next step as the uninterrupted run would.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["LossSpike", "Spike", "SpikeMonitor"]

MAD_TO_STD = 1.4826  # a normal distribution's standard deviation over its median absolute deviation
SPREAD_FLOOR = 1e-3  # of the median


class LossSpike(RuntimeError):
    """A loss or gradient-norm spike under spikes.policy = 'stop' (exit status 3, as a non-finite loss)."""


@dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    loss_median: float
    loss_z: float
    grad_norm: float
    grad_median: float
    grad_z: float

    def describe(self) -> str:
        return (
            f"loss {self.loss:.4f} (median {self.loss_median:.4f}, z {self.loss_z:.1f}), grad norm "
            f"{self.grad_norm:.3g} (median {self.grad_median:.3g}, z {self.grad_z:.1f})"
        )

    def metrics(self) -> dict[str, float]:
        return {"spike_loss_z": self.loss_z, "spike_grad_z": self.grad_z}


def _center_spread(values) -> tuple[float, float]:
    x = np.asarray(values, dtype=np.float64)
    median = float(np.median(x))
    spread = MAD_TO_STD * float(np.median(np.abs(x - median)))
    return median, max(spread, SPREAD_FLOOR * abs(median), 1e-12)


def _f32(x: float) -> float:
    return float(np.float32(x))


class SpikeMonitor:
    def __init__(self, cfg_spikes):
        self.policy = cfg_spikes.policy
        self.warmup, self.loss_z, self.grad_z = cfg_spikes.warmup, cfg_spikes.loss_z, cfg_spikes.grad_z
        self.losses: deque[float] = deque(maxlen=cfg_spikes.window)
        self.grads: deque[float] = deque(maxlen=cfg_spikes.window)

    @property
    def judging(self) -> bool:
        return self.policy != "off" and len(self.losses) >= self.warmup

    def thresholds(self) -> tuple[float, float]:
        """(loss, grad norm) above which the next step spikes, as float32 values (inf while not judging)."""
        if not self.judging:
            return math.inf, math.inf
        (loss_median, loss_spread), (grad_median, grad_spread) = map(_center_spread, (self.losses, self.grads))
        return _f32(loss_median + self.loss_z * loss_spread), _f32(grad_median + self.grad_z * grad_spread)

    def judge(self, step: int, loss: float, grad_norm: float) -> Spike | None:
        """The step's spike, if it is one (the thresholds' test, on the float32 values); a finite step that is not
        one enters the window."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return None  # the NaN policy's business
        loss_limit, grad_limit = self.thresholds()
        if _f32(loss) > loss_limit or _f32(grad_norm) > grad_limit:
            (loss_median, loss_spread), (grad_median, grad_spread) = map(_center_spread, (self.losses, self.grads))
            return Spike(
                step, loss, loss_median, (loss - loss_median) / loss_spread,
                grad_norm, grad_median, (grad_norm - grad_median) / grad_spread,
            )  # fmt: skip
        self.losses.append(loss)
        self.grads.append(grad_norm)
        return None

    # A DCP Stateful: one JSON string, the same on every rank (every rank judges the same global values).
    def state_dict(self) -> dict:
        return {"window": json.dumps({"losses": list(self.losses), "grads": list(self.grads)})}

    def load_state_dict(self, state: dict) -> None:
        saved = json.loads(state["window"])
        self.losses.clear()
        self.grads.clear()
        self.losses.extend(saved["losses"])
        self.grads.extend(saved["grads"])
