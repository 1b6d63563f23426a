"""Scalar Triton helpers shared by the Polar kernels (triton_attention.py, triton_decode.py): fp32, no libdevice.

Importing this module imports triton.
"""

import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """log(1 + e^x) without overflow."""
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def sigmoid(x):
    """Overflow-free logistic function."""
    z = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


@triton.jit
def log1p(x):
    """log(1 + x) that keeps its relative precision for tiny x (x >= 0)."""
    u = 1.0 + x
    tiny = u == 1.0
    return tl.where(tiny, x, tl.log(u) * (x / tl.where(tiny, 1.0, u - 1.0)))


@triton.jit
def tanh_nonneg(x):
    """tanh for x >= 0; a series below 1e-2 keeps small values exact."""
    e = tl.exp(-2.0 * x)
    series = x * (1.0 - x * x * (1.0 / 3.0 - x * x * (2.0 / 15.0)))
    return tl.where(x < 1e-2, series, (1.0 - e) / (1.0 + e))
