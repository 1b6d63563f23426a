"""Fault injection for the fault-tolerance tests (`[debug]` in the config): hooks the training step calls.

With every `[debug]` key at 0 each hook is the identity, so the step has no branches of its own for them.
"""

from __future__ import annotations

import os
import signal

import torch

__all__ = ["FaultInjector"]


class FaultInjector:
    def __init__(self, cfg_debug, rank: int):
        self.nan_at_step = cfg_debug.nan_at_step
        self.signal_at_step = cfg_debug.signal_at_step if rank == cfg_debug.signal_rank else 0

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch loss, made NaN at `debug.nan_at_step`."""
        return loss * float("nan") if step == self.nan_at_step else loss

    def after_backward(self, step: int) -> None:
        """At `debug.signal_at_step`, SIGTERM to this process when it is `debug.signal_rank`."""
        if step == self.signal_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
