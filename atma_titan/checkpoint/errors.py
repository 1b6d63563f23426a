"""Why a checkpoint cannot be used: all InputErrors, so every command turns them into exit status 2.

Torch-free. The messages name the checkpoint directory (its step) and the file, and say what is wrong.
"""

from __future__ import annotations

from atma_titan.utils.errors import InputError

__all__ = ["CheckpointError", "CheckpointNotFoundError", "UnsafeCheckpointError"]


class CheckpointError(InputError):
    """A checkpoint that cannot be loaded: missing, damaged, unverifiable, or refused as unsafe."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for (also a FileNotFoundError, as before manifests existed)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file whose unpickling would construct something other than checkpoint data."""
