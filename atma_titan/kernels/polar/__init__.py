"""Polar attention: streaming and materialised references, and the fused Triton kernel.

`polar_attention_triton` is registered through torch.library (ops.py); triton itself is imported on
its first call, so this package imports on machines without triton.
"""

from atma_titan.kernels.polar.ops import polar_attention_triton
from atma_titan.kernels.polar.reference import polar_attention, polar_attention_naive

__all__ = ["polar_attention", "polar_attention_naive", "polar_attention_triton"]
