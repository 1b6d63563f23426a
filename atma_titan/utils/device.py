"""One device policy for every command: training, evaluation, the sweep's cells and generation."""

from __future__ import annotations

from typing import Callable

import torch

from atma_titan.utils.errors import InputError

__all__ = ["cap_device_memory", "copy_to_host", "resolve_device"]


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
