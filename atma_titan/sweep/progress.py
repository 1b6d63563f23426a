"""A training cell's progress while it runs, read from the files its trainer writes: the steps logged in
metrics.jsonl against training.steps of its config.toml, the last loss, and the time left at the pace seen.

Torch-free until a line is said, so that `list` and `collect` stay light.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from atma_titan.run.folder import RunFolder

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

# Seconds between two looks at a training cell: a line each time a new step was logged since the last one.
PROGRESS_INTERVAL_S = 30.0


class TrainProgress:
    """Says where a training cell is, once per new logged step seen: 'step 40/100, loss 3.5010, 1m05s left'."""

    def __init__(self, run: RunFolder, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.run, self.say, self.clock = run, say, clock
        self.first: tuple[int, float] | None = None  # (step, time) first seen: the pace is measured from it
        self.last_step: int | None = None

    def poll(self) -> None:
        rows = self.run.logged_steps()
        if not rows or rows[-1]["step"] == self.last_step:
            return
        row, now = rows[-1], self.clock()
        step = int(row["step"])
        if self.first is None:
            self.first = (step, now)
        self.last_step = step
        self.say(self.describe(step, row["loss"], now))

    def describe(self, step: int, loss, now: float) -> str:
        from atma_titan.metrics import format_duration  # imports torch: only once a cell has logged a step

        total = self.total_steps()
        parts = [f"step {step}/{total}" if total else f"step {step}"]
        parts.append(f"loss {loss:.4f}" if isinstance(loss, (int, float)) else f"loss {loss}")
        first_step, first_seen = self.first
        if total and step > first_step:
            per_step = (now - first_seen) / (step - first_step)
            parts.append(f"{format_duration(per_step * (total - step))} left")
        return ", ".join(parts)

    def total_steps(self) -> int | None:
        """training.steps of the run's config.toml (the trainer writes it at its start)."""
        try:
            return int(tomllib.loads(self.run.config.read_text())["training"]["steps"])
        except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError):
            return None


class Every:
    """Calls `poll` every `interval` seconds in a thread of its own while the `with` block runs."""

    def __init__(self, poll: Callable[[], None], interval: float):
        self.poll, self.interval = poll, interval
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="sweep-progress", daemon=True)

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval):
            self.poll()

    def __enter__(self) -> Every:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()
