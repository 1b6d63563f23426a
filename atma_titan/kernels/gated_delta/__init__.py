"""Gated delta rule: exact recurrence and chunked (WY/UT) references, Triton kernels and ops.

Importing this package does not import triton: the kernels load on first use (ops.py).
"""

from atma_titan.kernels.gated_delta.ops import (
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
    "gated_delta_chunked",
    "gated_delta_chunked_fla",
    "gated_delta_chunked_triton",
    "gated_delta_recurrent",
    "gated_delta_step_",
    "gated_delta_step_inplace",
]
