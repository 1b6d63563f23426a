"""Soft-capped cross-entropy over rows of logits, forward and in-place backward (the LM head's loss).

- reference.py: the PyTorch reference and `softcap` itself.
- ops.py: the entry points `softcap_ce_forward`, `softcap_ce_backward_` (impl = auto | triton | reference).
- triton_ce.py: the Triton kernels and their launchers, imported on the first kernel call.
"""

from atma_titan.kernels.softcap_ce.ops import kernel_runs, softcap_ce_backward_, softcap_ce_forward
from atma_titan.kernels.softcap_ce.reference import (
    softcap,
    softcap_ce_backward_reference,
    softcap_ce_forward_reference,
)

__all__ = [
    "kernel_runs",
    "softcap",
    "softcap_ce_backward_",
    "softcap_ce_backward_reference",
    "softcap_ce_forward",
    "softcap_ce_forward_reference",
]
