"""One device policy for every command: training, evaluation, the sweep's cells and generation."""

from __future__ import annotations

import torch

from atma_titan.errors import InputError

__all__ = ["resolve_device"]


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
