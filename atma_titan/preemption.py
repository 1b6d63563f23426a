"""Graceful stop on SIGTERM / SIGUSR1: finish the step, save, exit; a second signal aborts at once.

SLURM sends SIGUSR1 (`--signal`) before the time limit and SIGTERM on preemption or scancel;
torchrun forwards SIGTERM to its workers. A process often gets the same stop twice within a moment
(from SLURM and again from torchrun), so only a second signal arriving `abort_after_s` or more
after the first counts as "abort now".
"""

from __future__ import annotations

import os
import signal
import sys
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    def __init__(self, abort_after_s: float = 2.0):
        self.abort_after_s = abort_after_s
        self.received: str | None = None
        self._first_at = 0.0
        self._previous = {}

    def install(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = name, now
            print(
                f"received {name}: finishing this step, saving a checkpoint, then exiting", file=sys.stderr, flush=True
            )
        elif now - self._first_at >= self.abort_after_s:
            print(f"received {name} again: aborting now without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)

    @property
    def requested(self) -> bool:
        return self.received is not None
