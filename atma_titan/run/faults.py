"""Fault injection for the fault-tolerance tests (`[debug]` in the config): hooks the training step calls.

With every `[debug]` key at 0 each hook is the identity, so the step has no branches of its own for them.
"""

from __future__ import annotations

import os
import signal
import time

import torch

__all__ = ["FaultInjector"]


class FaultInjector:
    def __init__(self, cfg_debug, rank: int):
        self.nan_at_step = cfg_debug.nan_at_step
        self.spike_at_step, self.spike_factor = cfg_debug.spike_at_step, cfg_debug.spike_factor
        self.signal_at_step = cfg_debug.signal_at_step if rank == cfg_debug.signal_rank else 0
        self.sleep_at_step = cfg_debug.sleep_at_step if rank == cfg_debug.signal_rank else 0
        self.sleep_seconds = cfg_debug.sleep_seconds

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch loss, made NaN at `debug.nan_at_step` and spike_factor times larger at `debug.spike_at_step`
        (its gradients too: a loss spike and a gradient-norm spike)."""
        if step == self.spike_at_step:
            return loss * self.spike_factor
        return loss * float("nan") if step == self.nan_at_step else loss

    def after_backward(self, step: int) -> None:
        """At `debug.signal_at_step`, SIGTERM to this process when it is `debug.signal_rank`; at
        `debug.sleep_at_step` that rank straggles (the other ranks wait for it in the step's next collective)."""
        if step == self.signal_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.sleep_at_step:
            self.straggle()

    def straggle(self) -> None:
        """A rank that falls behind: named in the watchdog's stack dump (tests/run/test_watchdog.py looks for it)."""
        time.sleep(self.sleep_seconds)
