"""Hang and straggler detection (`[watchdog]`): a daemon thread per rank that ends a step that runs far too long.

The training loop calls `step_started(step)` before a step and `step_ended()` after it (a clock read and an
assignment each, and a median of at most WINDOW numbers; no sync, no collective). The median is of the last
WINDOW completed steps, leaving out the first WARMUP_STEPS of the process (compilation, autotuning). Once a
step has run longer than `slow_factor` x that median and longer than `min_seconds`, the thread

- writes every thread's Python stack of this rank to `<dump_folder>/hangs/step-<N>.rank-<R>.txt`,
- prints one line on stderr naming the rank, the step, its time against the median, and the file,
- and, EXIT_DELAY_S later, ends the process with status HANG_EXIT (4) through `os._exit`: the main thread may
  be stuck inside a collective, where no exception would reach it. torchrun then tears the job down and
  SLURM requeues it.

Every rank runs its own watchdog, so the ranks waiting in a collective for a straggler dump their stacks
too: the straggler is the one rank whose stack is not inside the collective, and its stack says where it
is. Only the time inside `train_step` is judged: validation, the metrics line and checkpoint saves happen
between `step_ended` and the next `step_started`. Until MIN_SAMPLES steps are timed nothing is judged (a
hang then is left to the collective timeout, `parallelism.timeout_s`).

Why a Python thread rather than `faulthandler.dump_traceback_later(timeout, exit=True)`: that C timer is
armed with a fixed timeout and file, exits with status 1 (a crash like any other) and cannot say which
rank, step or median it judged; the limit here follows the running median, the file is named by the step,
and the status tells a hang apart. Its one advantage, a C thread that runs while the main thread holds the
GIL, matters little: torch releases the GIL while it waits for a collective, a device copy or a sleep,
which is where a hung step waits. The dump itself is `faulthandler.dump_traceback`, which reads every
thread's frames without their cooperation. A step stuck in C code that keeps the GIL is left to
`parallelism.timeout_s`.

Torch-free.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["HANGS_FOLDER", "HANG_EXIT", "Hang", "Watchdog"]

HANG_EXIT = 4  # distinct from 1 (a crash or failed export), 2 (bad input), 3 (a NaN loss)
HANGS_FOLDER = "hangs"
WARMUP_STEPS = 3  # the first steps of a process compile and autotune: never part of the median
MIN_SAMPLES = 5  # steps timed before the median is trusted
WINDOW = 20  # the median is over the last WINDOW timed steps
KEEP_HANGS = 5  # hangs (steps) whose dumps are kept in hangs/; older ones are removed when a new one is written
EXIT_DELAY_S = 5.0  # see _fire


@dataclass(frozen=True)
class Hang:
    step: int
    ran_s: float
    median_s: float
    samples: int
    limit_s: float

    def describe(self, rank: int) -> str:
        ratio = self.ran_s / self.median_s if self.median_s > 0 else float("inf")
        return (
            f"rank {rank}: step {self.step} has run {self.ran_s:.1f} s, {ratio:.0f}x the "
            f"median step of {self.median_s:.3g} s over the last {self.samples} steps (limit {self.limit_s:.1f} s)"
        )


class Watchdog:
    """`Watchdog(...).start()`, then `step_started(step)` / `step_ended()` around each training step, `stop()`
    at the end. slow_factor 0 turns it off (no thread; the step calls only record)."""

    def __init__(
        self,
        folder: str | Path,
        rank: int,
        slow_factor: float,
        min_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], object] = os._exit,
        poll_s: float = 1.0,
        exit_delay_s: float = EXIT_DELAY_S,
    ):
        self.folder = Path(folder) / HANGS_FOLDER
        self.rank = rank
        self.slow_factor = slow_factor
        self.min_seconds = min_seconds
        self.clock, self.exit = clock, exit
        self.poll_s, self.exit_delay_s = poll_s, exit_delay_s
        self.fired: Hang | None = None
        self._times: deque[float] = deque(maxlen=WINDOW)
        self._ended = 0  # steps completed by this process, the warm-up ones included
        # Published by the training thread as whole objects, read by the watchdog thread: no lock needed.
        self._current: tuple[int, float] | None = None  # (step, its start)
        self._median: float | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg_watchdog, folder: str | Path, rank: int) -> Watchdog:
        return cls(folder, rank, cfg_watchdog.slow_factor, cfg_watchdog.min_seconds)

    @property
    def enabled(self) -> bool:
        return self.slow_factor > 0

    def start(self) -> Watchdog:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="atma-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            # Once a hang is declared the process ends with HANG_EXIT, also when the main thread gets out first
            # (a peer's exit broke its collective): wait for the thread's exit instead of returning.
            self._thread.join(None if self.fired else 5.0)

    # -- the training thread's two calls

    def step_started(self, step: int) -> None:
        self._current = (step, self.clock())

    def step_ended(self) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        self._ended += 1
        if self._ended <= WARMUP_STEPS:
            return
        self._times.append(self.clock() - current[1])
        if len(self._times) >= MIN_SAMPLES:
            self._median = statistics.median(self._times)

    # -- the watchdog thread

    def limit(self) -> float | None:
        """How long the current kind of step may run, None while there is no median."""
        median = self._median
        return None if median is None else max(self.min_seconds, self.slow_factor * median)

    def check(self) -> Hang | None:
        """The running step, when it has run past the limit."""
        current, median, limit = self._current, self._median, self.limit()
        if current is None or limit is None or not self.enabled:
            return None
        step, began = current
        ran = self.clock() - began
        return Hang(step, ran, median, len(self._times), limit) if ran > limit else None

    def _watch(self) -> None:
        while not self._stopped.is_set():
            hang = self.check()
            if hang is not None:
                self._fire(hang)
                return
            self._stopped.wait(self._wait_s())

    def _wait_s(self) -> float:
        """Until the running step's deadline (so that every rank fires moments apart), at most poll_s."""
        current, limit = self._current, self.limit()
        if current is None or limit is None:
            return self.poll_s
        return min(self.poll_s, max(current[1] + limit - self.clock(), 0.0) + 0.01)

    def _fire(self, hang: Hang) -> None:
        self.fired = hang
        where = self.dump(hang)
        message = f"watchdog: {hang.describe(self.rank)}; stacks of every thread in {where}; exiting with status "
        message += f"{HANG_EXIT} (watchdog.slow_factor {self.slow_factor:g}, watchdog.min_seconds {self.min_seconds:g})"
        # os.write, not print: the main thread may hold sys.stderr's lock, stuck in a write.
        os.write(2, (message + "\n").encode())
        # The other ranks' deadlines fall moments after this one; exiting at once would break their collectives
        # (gloo raises when a peer is gone) before their watchdogs dump where they wait.
        self._stopped.wait(self.exit_delay_s)
        self.exit(HANG_EXIT)

    def dump(self, hang: Hang) -> str:
        """Every thread's stack into hangs/step-<N>.rank-<R>.txt (on stderr where it cannot be written)."""
        path = self.folder / f"step-{hang.step}.rank-{self.rank}.txt"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            prune(self.folder, keep_step=hang.step)
            with open(path, "w") as f:
                f.write(f"{hang.describe(self.rank)}\n\n")
                f.flush()  # faulthandler writes to the descriptor, after what is buffered here
                faulthandler.dump_traceback(f, all_threads=True)
            return str(path)
        except OSError as e:
            faulthandler.dump_traceback(2, all_threads=True)  # fd 2: as the message, past sys.stderr's lock
            return f"stderr above (writing {path} failed: {e})"


def prune(folder: Path, keep_step: int, keep: int = KEEP_HANGS) -> None:
    """Remove the dumps of all but the newest `keep` - 1 hangs besides step `keep_step`'s, so a job that hangs
    at every requeue does not fill the folder (step-<N>.rank-<R>.txt: one file per rank per hang)."""
    newest: dict[str, float] = {}  # step -> the time of its newest file
    files: dict[str, list[Path]] = {}
    for path in folder.glob("step-*.rank-*.txt"):
        step = path.name.split(".", 1)[0]
        try:
            newest[step] = max(newest.get(step, 0.0), path.stat().st_mtime)
        except FileNotFoundError:  # another rank pruned it
            continue
        files.setdefault(step, []).append(path)
    older = sorted((s for s in newest if s != f"step-{keep_step}"), key=newest.get, reverse=True)
    for step in older[max(keep - 1, 0) :]:
        for path in files[step]:
            path.unlink(missing_ok=True)
