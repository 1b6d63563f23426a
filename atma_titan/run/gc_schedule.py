"""Python's garbage collection at fixed steps of a training run (`training.gc_interval`).

Left automatic, a collection runs whenever allocations pass a threshold: at a step no one chose, on one
rank at a time. A full collection walks every tracked object, compiled graphs and their caches included,
and took 30-400 ms on the 370M model, which is a whole step at one micro-batch per step, and on many
ranks every other rank waits for it at the next collective. So, as torchtitan does, automatic collection
is off during the loop and the young generations (0 and 1) are collected every `interval` steps, on every
rank at the same step: short, and at once. The loop's long-lived objects need no collection; what
survives into the old generation is collected when the run ends and the collector is back on.
"""

from __future__ import annotations

import gc

__all__ = ["GCSchedule"]


class GCSchedule:
    """`with GCSchedule(interval) as gc_schedule:` around the loop, `gc_schedule.step(step)` after each step.
    interval 0 leaves Python's automatic collection as it is."""

    def __init__(self, interval: int):
        self.interval = interval
        self._was_enabled = False

    def __enter__(self) -> GCSchedule:
        if self.interval:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect(1)
        return self

    def step(self, step: int) -> None:
        if self.interval and step % self.interval == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.interval and self._was_enabled:
            gc.enable()
