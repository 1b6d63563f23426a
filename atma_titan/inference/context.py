"""Running a model for evaluation: the inference context and right-padding of ragged batches.

Inference runs the model in eval mode under `torch.no_grad`, with bf16 autocast on CUDA (as training
computes) and fp32 on the CPU; the model's previous train/eval mode is restored afterwards, so the
trainer can call an evaluation in the middle of a run.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["evaluating", "model_device", "pad_right"]


def model_device(model: nn.Module) -> torch.device:
    """The device the model's (local) parameters live on."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def evaluating(model: nn.Module, autocast_dtype: torch.dtype | None = torch.bfloat16) -> Iterator[torch.device]:
    """eval mode + no_grad (+ autocast on CUDA); yields the model's device and restores its mode."""
    device = model_device(model)
    was_training = model.training
    model.eval()
    use_autocast = device.type == "cuda" and autocast_dtype is not None
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=autocast_dtype, enabled=use_autocast):
            yield device
    finally:
        model.train(was_training)


def pad_right(sequences: Sequence[np.ndarray], pad_id: int) -> torch.Tensor:
    """Stack sequences of different lengths into (B, max_len), padding at the end.

    Safe for a causal model: padding after a position cannot change that position's output, so
    the scored positions see exactly the unpadded sequence.
    """
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), int(pad_id), dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.as_tensor(np.asarray(seq, dtype=np.int64))
    return out
