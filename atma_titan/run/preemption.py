"""Graceful stop on SIGTERM / SIGUSR1 / SIGINT and on the death of torchrun: finish the step, save, exit.

SLURM sends SIGUSR1 (`--signal`) before the time limit and SIGTERM on preemption or scancel;
torchrun forwards SIGTERM and SIGINT to its workers; Ctrl-C in a terminal is SIGINT (to the whole
foreground process group). A process often gets the same stop twice within a moment (from SLURM or
the terminal and again from torchrun), so only a second signal arriving `abort_after_s` or more
after the first counts as "abort now".

The handler acts in the process that installed it only: a forked child (a DataLoader worker) keeps
running on the signal, since its parent is stopping anyway and still needs its batches for the
step it finishes and the loader state it saves.

Under torchrun a trainer also stops when its launcher dies (`LauncherWatch`): torch starts each
worker in a session of its own, so a SIGKILL of torchrun (or the OOM killer) would otherwise leave
the trainers running, writing checkpoints into a run nobody waits for.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class LauncherWatch:
    """The launcher of this process under torchrun, to notice when it dies.

    Only under torchrun (TORCHELASTIC_RUN_ID is set; LOCAL_RANK alone is also set by other launchers
    whose process tree is unknown): there the parent is the elastic agent, which lives exactly as long
    as the job. A plain `python -m atma_titan.train` has a shell as its parent, and a shell that exits
    (a closed terminal under nohup, a finished batch script step) says nothing about the run, so it is
    not watched.

    The kernel's death signal comes when the thread that started this process exits: torchrun starts
    its workers from its main thread, so that is torchrun's exit. It may come while the dying agent's
    other threads still hold this process (getppid unchanged for a moment), so the signal counts as a
    plain SIGTERM; the per-step `gone` check is the backstop where no signal comes (not Linux)."""

    def __init__(self, parent: int | None):
        self.parent = parent

    @classmethod
    def start(cls) -> LauncherWatch:
        """Watch the parent when under torchrun: SIGTERM from the kernel when it dies (Linux), and its pid."""
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            return cls(None)
        parent = os.getppid()  # read before the prctl: a launcher dying in between shows in `gone`
        set_parent_death_signal(signal.SIGTERM)
        return cls(parent)

    def gone(self) -> bool:
        """True once the launcher has died: this process was handed to another parent (init or a subreaper)."""
        return self.parent is not None and os.getppid() != self.parent


def set_parent_death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig) on Linux; False where there is no such call (the per-step check remains)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class StopRequest:
    def __init__(self, abort_after_s: float = 2.0, launcher: LauncherWatch | None = None):
        self.abort_after_s = abort_after_s
        self.launcher = launcher
        self.received: str | None = None
        self._first_at = 0.0
        self._previous = {}
        self._pid = os.getpid()

    def install(self) -> "StopRequest":
        self._pid = os.getpid()
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            return  # a forked child (a loader worker): the process that installed the handler stops for it
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.received is None:
            self._request(name, now)
        elif now - self._first_at >= self.abort_after_s:
            print(f"received {name} again: aborting now without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)

    def _request(self, why: str, now: float) -> None:
        self.received, self._first_at = why, now
        print(f"received {why}: finishing this step, saving a checkpoint, then exiting", file=sys.stderr, flush=True)

    def check_launcher(self) -> None:
        """Called once a step: a launcher that died is a stop request (where no death signal came)."""
        if self.received is None and self.launcher is not None and self.launcher.gone():
            self._request("launcher exited", time.monotonic())

    @property
    def requested(self) -> bool:
        return self.received is not None
