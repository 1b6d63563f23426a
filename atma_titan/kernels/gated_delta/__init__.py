"""Gated delta rule: one entry point, `gated_delta(..., impl=auto | triton | reference | fla)`.

- reference.py: the PyTorch references, `gated_delta_recurrent` (exact per-token recurrence; ground
  truth), `gated_delta_chunked` (chunked WY / UT form) and the decode steps.
- ops.py: the torch.library custom ops of the Triton kernels, `gated_delta_chunked_triton`,
  `gated_delta_step_` (in-place decode step), the flash-linear-attention wrapper
  `gated_delta_chunked_fla` and the dispatching `gated_delta`.
- triton_chunked.py, triton_step.py: the Triton kernels (chunked forward / backward, decode step)
  and their launchers.

Every chunked entry point takes `doc_start` (B, T) (kernels/documents.py): the state is zeroed before
each document start, so the documents packed in one window stay apart; the decode step serves one
document per sequence.

Importing this package does not import triton: the kernels load on first use (ops.py).
"""

from atma_titan.kernels.gated_delta.ops import (
    gated_delta,
    gated_delta_chunked_fla,
    gated_delta_chunked_triton,
    gated_delta_step_,
)
from atma_titan.kernels.gated_delta.reference import (
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_step_inplace,
)

__all__ = [
    "gated_delta",
    "gated_delta_chunked",
    "gated_delta_chunked_fla",
    "gated_delta_chunked_triton",
    "gated_delta_recurrent",
    "gated_delta_step_",
    "gated_delta_step_inplace",
]
