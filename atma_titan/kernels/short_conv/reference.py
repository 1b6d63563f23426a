"""The math of the LFM2 block's gated short convolution (docs/model.md section 2), in PyTorch.

    [b, c, x] = z               in_proj's output, split into thirds (the backward takes it without its
                                bias and the bias apart: z = u + bias)
    p = b * x
    y[t] = sum_j w[:, j] p[t - (k-1) + j]      causal, depthwise, zero before each sequence's start
    o = c * y                   out_proj's input

and its backward, given do = dL/do:

    dc = do * y                 dy = do * c
    dp[t] = sum_j w[:, j] dy[t + (k-1) - j]    zero past each sequence's end
    db = dp * x                 dx = dp * b
    dw[:, j] = sum_t dy[t] p[t - (k-1) + j]    the convolution's weight gradient
    bias gradient of in_proj = the column sums of [db, dc, dx]

The backward also returns o again: out_proj's weight gradient needs it, and recomputing it in the same
pass over z costs one more write instead of a second read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv", "gated_conv", "gated_conv_backward_reference"]


def causal_conv(padded: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y[t] = sum_j w[:, j] padded[t + j] for padded (B, k - 1 + T, C) (the k - 1 inputs before each
    sequence, then the sequence) and weight (C, k): a sum of k shifted products, element-wise work
    that torch.compile fuses, where a grouped conv1d is a slow, unfused kernel for kernels this short."""
    k = weight.shape[1]
    T = padded.shape[1] - (k - 1)
    w = weight.to(padded.dtype)
    y = padded[:, k - 1 : k - 1 + T] * w[:, k - 1]
    for j in range(k - 1):
        y = y + padded[:, j : j + T] * w[:, j]
    return y


def gated_conv(z: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """o = c * conv(b * x) for [b, c, x] = z (B, T, 3C) and the conv weight (C, k), zero-padded."""
    b, c, x = z.chunk(3, dim=-1)
    return c * causal_conv(F.pad(b * x, (0, 0, weight.shape[1] - 1, 0)), weight)


def gated_conv_backward_reference(
    u: torch.Tensor, do: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dz, o, column sums of dz, dw) for z = u + bias, u (B, T, 3C), bias (3C,) or None, do (B, T, C) and
    the conv weight (C, k). Computes in fp32 (fp64 for fp64 input); dz and o come back in u's dtype, the
    sums and dw in the compute dtype."""
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    z = u.to(compute) if bias is None else u.to(compute) + bias.to(compute)
    w = weight.to(compute)
    k, T = w.shape[1], z.shape[1]
    b, c, x = z.chunk(3, dim=-1)
    p = F.pad(b * x, (0, 0, k - 1, 0))
    y = causal_conv(p, w)
    do = do.to(compute)
    dy = F.pad(do * c, (0, 0, 0, k - 1))
    dp = sum(dy[:, k - 1 - j : k - 1 - j + T] * w[:, j] for j in range(k))
    dw = torch.stack([(dy[:, :T] * p[:, j : j + T]).sum((0, 1)) for j in range(k)], dim=-1)
    dz = torch.cat([dp * x, do * y, dp * b], dim=-1)
    return dz.to(u.dtype), (c * y).to(u.dtype), dz.sum((0, 1)), dw
