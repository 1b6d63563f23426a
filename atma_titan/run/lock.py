"""One training job per run folder: `<dump_folder>/LOCK`, taken by rank 0 at the start of a run.

Two jobs training into one folder would overwrite each other's checkpoints, metrics and DONE, so
the second one stops before it reads or writes anything (FolderLocked: exit status 2) and names the
holder. The lock is a small JSON file: who holds it (host, pid, SLURM job, torchrun run), when it was
taken, and a heartbeat refreshed every HEARTBEAT_S by a daemon thread (so a long set-up, compile,
evaluation or save never lets it age). It is removed when the run ends, however it ends, except
when the process is killed (SIGKILL, a second Ctrl-C, a crashed host): such a lock is stale and the
next job takes it over with a warning when

- its heartbeat is older than STALE_AFTER_S (the holder is dead, frozen, or on a host that is gone), or
- it was written on this host (same boot) and its process is gone, or
- it was written by this same SLURM job (or torchrun run) on another host: a requeue, whose old
  processes SLURM has already killed, and which must not wait for the timeout.

The folder's readers (eval, sweep reports) take no lock. Torch-free except `lock_run_folder`, which
tells every rank what rank 0 found.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from atma_titan.utils.atomic import create_text_exclusive, write_json_atomic
from atma_titan.utils.errors import InputError

__all__ = ["HEARTBEAT_S", "LOCK_NAME", "STALE_AFTER_S", "FolderLock", "FolderLocked", "lock_run_folder"]

LOCK_NAME = "LOCK"
HEARTBEAT_S = 30.0
# 20 missed heartbeats: far beyond a slow shared filesystem or a busy host delaying the heartbeat
# thread, so a live job never loses its folder; short enough that a new job after a crash on another
# host (where the pid cannot be checked) waits minutes, not hours. A requeue of the same SLURM job and
# a restart on the same host do not wait at all (see the module docstring).
STALE_AFTER_S = 600.0


class FolderLocked(InputError):
    """Another job holds the run folder (or the lock cannot be written): exit status 2."""


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The start time of `pid` (clock ticks since boot, /proc/<pid>/stat field 22): tells a reused pid apart."""
    stat = _read_first_line(f"/proc/{pid}/stat")
    fields = stat.rpartition(")")[2].split()  # the command name in parentheses may hold spaces
    return fields[19] if len(fields) > 19 else ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _alive(pid, started: str) -> bool:
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return True  # unknown: assume the holder lives
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return not started or _process_start(pid) in ("", started)


def this_process() -> dict:
    """The lock's content for this process; `token` tells this lock instance apart from any later one."""
    now = time.time()
    env = os.environ
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": env.get("SLURM_JOB_ID", ""),
        "torchrun_run_id": env.get("TORCHELASTIC_RUN_ID", ""),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(now)),
        "heartbeat": now,
        "boot_id": _read_first_line("/proc/sys/kernel/random/boot_id"),
        "pid_namespace": _pid_namespace(),
        "pid_start": _process_start(os.getpid()),
        "token": uuid.uuid4().hex,
    }


def describe(holder: dict) -> str:
    parts = [f"host {holder.get('host') or '?'}", f"pid {holder.get('pid', '?')}"]
    if holder.get("slurm_job_id"):
        parts.append(f"SLURM job {holder['slurm_job_id']}")
    if holder.get("torchrun_run_id") and holder.get("torchrun_run_id") != holder.get("slurm_job_id"):
        parts.append(f"torchrun run {holder['torchrun_run_id']}")
    return ", ".join(parts)


def format_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def why_stale(holder: dict, me: dict, now: float) -> str | None:
    """Why the holder's lock may be taken over, or None while it may still be alive."""
    age = now - float(holder.get("heartbeat", 0))
    if age > STALE_AFTER_S:
        return f"its heartbeat is {format_age(age)} old (stale after {format_age(STALE_AFTER_S)})"
    same_host = holder.get("host") == me["host"]
    if same_host and holder.get("boot_id") and holder["boot_id"] != me["boot_id"]:
        return "this host has restarted since"
    # The pid says something only on this host and in this pid namespace (not from inside another container).
    pid_checkable = same_host and holder.get("pid_namespace", "") == me["pid_namespace"]
    if pid_checkable:
        if not _alive(holder.get("pid"), str(holder.get("pid_start", ""))):
            return f"its process {holder.get('pid')} is no longer running"
        return None
    for key, what in (("slurm_job_id", "SLURM job"), ("torchrun_run_id", "torchrun run")):
        if holder.get(key) and holder[key] == me[key]:
            return f"it was written by this same {what} ({me[key]}) before a requeue or restart"
    return None


def _read(path: Path) -> dict | None:
    """The lock's content; None when there is no lock. An unreadable one (cut short) counts by its file time."""
    try:
        text = path.read_text()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
        if isinstance(holder, dict):
            return holder
    except ValueError:
        pass
    return {"host": "", "pid": "?", "heartbeat": mtime, "token": ""}


def _create(path: Path, content: dict) -> bool:
    """Create the lock atomically with its whole content; False when it already exists."""
    return create_text_exclusive(path, json.dumps(content, indent=2) + "\n", durable=True)


def _remove_stale(path: Path, holder: dict) -> bool:
    """Move the stale lock out of the way; False when another job got there first (it may now hold it)."""
    moved = path.with_name(f".{path.name}.stale.{uuid.uuid4().hex}")
    try:
        os.rename(path, moved)
    except FileNotFoundError:
        return False
    taken = _read(moved)
    if taken is not None and taken.get("token") != holder.get("token"):
        # A third job replaced the stale lock between our read and our rename: give it back.
        try:
            os.link(moved, path)
        except OSError:
            pass
        moved.unlink(missing_ok=True)
        return False
    moved.unlink(missing_ok=True)
    return True


class FolderLock:
    """The held lock of one run folder: heartbeats in a daemon thread until `release`."""

    def __init__(self, path: Path, content: dict):
        self.path, self.content = path, content
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="folder-lock-heartbeat", daemon=True)

    @classmethod
    def acquire(cls, folder: Path) -> FolderLock:
        """Take `<folder>/LOCK` (creating the folder), taking over a stale one with a warning; or FolderLocked."""
        path = Path(folder) / LOCK_NAME
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(5):  # a few rounds: a lock released or taken over while we look
                me = this_process()
                if _create(path, me):
                    lock = cls(path, me)
                    lock._thread.start()
                    return lock
                holder = _read(path)
                if holder is None:
                    continue  # released in the meantime
                reason = why_stale(holder, me, time.time())
                if reason is None:
                    raise FolderLocked(held_message(path, holder))
                if _remove_stale(path, holder):
                    print(
                        f"warning: taking over the stale lock {path} of {describe(holder)} "
                        f"(started {holder.get('started', '?')}): {reason}",
                        file=sys.stderr,
                        flush=True,
                    )
        except OSError as e:
            raise FolderLocked(
                f"cannot write the lock {path} of job.dump_folder: {e.strerror or e}; "
                "job.dump_folder must be a folder this job can create and write"
            ) from e
        raise FolderLocked(f"could not take the lock {path}: other jobs keep taking it; is another job starting there?")

    def _beat(self) -> None:
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                current = _read(self.path)
                if current is None or current.get("token") != self.content["token"]:
                    print(
                        f"warning: the lock {self.path} is no longer this job's"
                        + (f" (now held by {describe(current)})" if current else " (it was removed)")
                        + "; another job may be writing into this run folder",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
                self.content["heartbeat"] = time.time()
                write_json_atomic(self.path, self.content, durable=True)
                warned = False
            except OSError as e:  # a filesystem hiccup: keep trying; the timeout is 20 heartbeats long
                if not warned:
                    print(f"warning: could not refresh the lock {self.path}: {e}", file=sys.stderr, flush=True)
                    warned = True

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still this job's."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        current = _read(self.path)
        if current is not None and current.get("token") == self.content["token"]:
            self.path.unlink(missing_ok=True)


def held_message(path: Path, holder: dict) -> str:
    age = format_age(time.time() - float(holder.get("heartbeat", 0)))
    return (
        f"job.dump_folder {path.parent} is in use by another training job: {describe(holder)} "
        f"(started {holder.get('started', '?')}, last heartbeat {age} ago). Wait for that job to end or stop it, "
        f"or choose another job.dump_folder. If it is not running any more, delete {path} and start again "
        f"(a lock whose heartbeat is older than {format_age(STALE_AFTER_S)} is taken over by itself)."
    )


def lock_run_folder(folder: Path, *, distributed: bool, is_main: bool) -> FolderLock | None:
    """Rank 0 takes the lock; every rank learns what it found, so all ranks raise FolderLocked together.

    Returns the lock on rank 0 (None elsewhere). Under torchrun this is a collective: call it on every rank."""
    lock, refused = None, None
    if is_main:
        try:
            lock = FolderLock.acquire(folder)
        except FolderLocked as e:
            refused = str(e)
        except BaseException:
            if distributed:  # the other ranks must not wait for an answer that never comes
                _broadcast_from_rank0(f"rank 0 failed while taking the lock of {folder} (its traceback says why)")
            raise
    if distributed:
        refused = _broadcast_from_rank0(refused)
    if refused is not None:
        if lock is not None:
            lock.release()
        raise FolderLocked(refused)
    return lock


def _broadcast_from_rank0(value: str | None) -> str | None:
    import torch
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))  # over gloo, also under "cpu:gloo,cuda:nccl"
    return box[0]
