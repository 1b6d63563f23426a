"""Learning-rate schedules: one factor of the peak rate per step, applied to every optimizer alike."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from atma_titan.config import LRScheduler

if TYPE_CHECKING:
    from atma_titan.optim.container import Optimizers


def lr_factor(cfg: LRScheduler, total_steps: int, decay_from: int | None = None) -> Callable[[int], float]:
    """Multiplier of each group's peak lr for the optimizer step that follows `done` completed steps.

    `decay_from`: the completed steps after which constant_then_linear decays (a data stage's start,
    lr_scheduler.decay_stage), instead of `decay_start` x the steps."""
    warmup = cfg.warmup_steps
    floor = cfg.min_lr_ratio

    def constant_then_linear(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        start = max(warmup, int(cfg.decay_start * total_steps) if decay_from is None else decay_from)
        if done < start:
            return 1.0
        progress = (done - start) / max(1, total_steps - start)
        return floor + (1.0 - floor) * max(0.0, 1.0 - progress)

    def warmup_cosine(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        progress = min(1.0, (done - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return {"constant_then_linear": constant_then_linear, "warmup_cosine": warmup_cosine}[cfg.name]


class LRSchedules:
    """One LambdaLR per optimizer, all following the same factor."""

    def __init__(self, optimizers: Optimizers, cfg: LRScheduler, total_steps: int, decay_from: int | None = None):
        factor = lr_factor(cfg, total_steps, decay_from)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict:
        return {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}

    def load_state_dict(self, state: dict) -> None:
        for i, s in enumerate(self.schedulers):
            s.load_state_dict(state[str(i)])

    def follow(self) -> None:
        """Set every group's lr to this schedule's value for the next step.

        After a resume the optimizers hold the lr their saved run had reached, which is that run's
        schedule (with fewer total steps, the last one decayed to its floor): the next step must use
        this run's."""
        for s in self.schedulers:
            lrs = [base * factor(s.last_epoch) for base, factor in zip(s.base_lrs, s.lr_lambdas)]
            for group, lr in zip(s.optimizer.param_groups, lrs):
                group["lr"] = lr
            s._last_lr = lrs  # what get_last_lr() reports
