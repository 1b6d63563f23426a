"""Warnings every run triggers that tell the user nothing: each command silences them once at start."""

from __future__ import annotations

import warnings


def silence_known_warnings() -> None:
    # DCP warns on every save and load made without torch.distributed (also from the async writer
    # thread, where a local catch_warnings cannot reach); one process is a mode we support on purpose.
    warnings.filterwarnings(
        "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized", category=UserWarning
    )
    # torchdata 0.11 calls torch.set_vital, deprecated since torch 2.12.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
