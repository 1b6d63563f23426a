"""One device policy for every command: training, evaluation, the sweep's cells and generation."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from atma_titan.utils.errors import InputError

__all__ = [
    "CpuThreads",
    "cap_device_memory",
    "choose_cpu_threads",
    "copy_to_host",
    "load_average",
    "resolve_device",
    "set_cpu_threads",
    "usable_cores",
]


def resolve_device(name: str, local_rank: int = 0, what: str = "--device") -> torch.device:
    """'auto' (this rank's GPU when CUDA is present, else the CPU), 'cpu', 'cuda' (this rank's GPU) or 'cuda:N'.

    `local_rank` is torchrun's LOCAL_RANK (0 in one process); `what` names the option in the message.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"{what} = {name!r} is not a device; allowed: auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"{what} = {name!r} is not supported; allowed: auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"{what} = {name!r} but no CUDA device is available; use auto or cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def cap_device_memory(device: torch.device, cap_gib: float) -> None:
    """Let this process allocate at most `cap_gib` GiB of `device` (a smaller GPU's budget on a larger one).

    The caching allocator raises out-of-memory past the cap as it would on the smaller GPU; 0 means no cap."""
    if cap_gib <= 0 or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if cap_gib * 2**30 >= total:
        raise InputError(f"debug.memory_cap_gib = {cap_gib} is not below this GPU's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, device)


def copy_to_host(tensor: torch.Tensor) -> Callable[[], list]:
    """Start copying `tensor` to the host; the returned function waits for that copy alone and gives its values.

    `tensor.tolist()` on a GPU waits for every kernel queued so far; this waits only for those queued before
    the call, so the caller may queue more work first and have the GPU run it while the host waits."""
    if tensor.device.type != "cuda":
        return tensor.tolist
    host = tensor.to("cpu", non_blocking=True)  # into pinned memory
    copied = torch.cuda.Event()
    copied.record()

    def values() -> list:
        copied.synchronize()
        return host.tolist()

    return values


@dataclass(frozen=True)
class CpuThreads:
    """torch's intra-op threads for one process, and where the number came from."""

    count: int
    reason: str
    cores: int  # usable by this process
    local_ranks: int  # torchrun's processes on this machine, this one included

    def describe(self) -> str:
        return f"cpu threads: {self.count} per rank ({self.reason})"

    def crowded(self, load: float) -> str | None:
        """A warning when the other work on the machine (`load`: its load average before this job ran) and this
        job's threads add up to more than the cores: the threads of one op then wait for each other."""
        if self.count == 1 or load + self.count * self.local_ranks <= self.cores + 0.5:
            return None
        return (
            f"the load average is {load:.1f} on {self.cores} cores: another job shares them, and {self.count} "
            "threads per rank then wait at every op for one that is descheduled (a run can take 10x longer); "
            "OMP_NUM_THREADS=1 avoids that"
        )


def usable_cores() -> int:
    """The cores this process may run on (a taskset or a batch scheduler's affinity), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def choose_cpu_threads(environ: Mapping[str, str] = os.environ, cores: int | None = None) -> CpuThreads:
    """OMP_NUM_THREADS when set; else the usable cores shared out among torchrun's local ranks, at least 1.

    Every rank taking every core oversubscribes them: an op's threads then wait at its end for a thread the
    kernel has descheduled, at every op (docs/training.md, "Threads on a CPU")."""
    cores = usable_cores() if cores is None else cores
    local_ranks = _positive(environ.get("LOCAL_WORLD_SIZE")) or 1
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    threads = _positive(omp)
    if threads is not None:
        # torchrun sets 1 for more than one local rank unless the variable is set already
        by_torchrun = ", torchrun's default for several local ranks" if local_ranks > 1 and threads == 1 else ""
        return CpuThreads(threads, f"OMP_NUM_THREADS={omp}{by_torchrun}", cores, local_ranks)
    ignored = f"OMP_NUM_THREADS={omp!r} is not a positive integer" if omp else "OMP_NUM_THREADS unset"
    ranks = f"{local_ranks} local rank{'s' if local_ranks > 1 else ''}"
    return CpuThreads(max(1, cores // local_ranks), f"{cores} cores / {ranks}; {ignored}", cores, local_ranks)


def set_cpu_threads(device: torch.device, environ: Mapping[str, str] = os.environ) -> CpuThreads | None:
    """Give torch the chosen intra-op threads when `device` is the CPU (a GPU's host threads are left alone)."""
    if device.type != "cpu":
        return None
    choice = choose_cpu_threads(environ)
    torch.set_num_threads(choice.count)
    return choice


def load_average() -> float | None:
    """The machine's 1-minute load average (runnable processes), where the system has one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _positive(text: str | None) -> int | None:
    try:
        value = int(text)
    except (TypeError, ValueError):
        return None
    return value if value >= 1 else None
