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

Documents (`doc_start`, kernels/documents.py): the convolution's history is zero at a document start, so
output t's tap j, which reads s = k-1-j steps back, counts only where s <= t - doc_start[t] (its
`reach`); the backward drops the same terms: dy[t] reaches dp[t - s] and dw[:, j] only through a tap t uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atma_titan.kernels.documents import check_doc_start, positions_in_document

__all__ = ["causal_conv", "gated_conv", "gated_conv_backward_reference"]


def _reach(doc_start: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T, 1): how many steps back each output's taps may read. Its position in its document, or every
    tap (k - 1) where its document began at or before the window's start: there the k - 1 rows before the
    window (zero padding, or generation's conv state) are that document's own history."""
    return positions_in_document(doc_start).masked_fill(doc_start == 0, k - 1).unsqueeze(-1)


def causal_conv(padded: torch.Tensor, weight: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] = sum_j w[:, j] padded[t + j] for padded (B, k - 1 + T, C) (the k - 1 inputs before each
    sequence, then the sequence) and weight (C, k): a sum of k shifted products, element-wise work
    that torch.compile fuses, where a grouped conv1d is a slow, unfused kernel for kernels this short.
    With doc_start (B, T), a tap reading before t's document start adds nothing; the k - 1 leading rows
    are read only by outputs whose doc_start is 0."""
    k = weight.shape[1]
    T = padded.shape[1] - (k - 1)
    check_doc_start(doc_start, padded.shape[0], T)
    reach = None if doc_start is None else _reach(doc_start, k)
    w = weight.to(padded.dtype)
    y = padded[:, k - 1 : k - 1 + T] * w[:, k - 1]
    for j in range(k - 1):
        tap = padded[:, j : j + T]
        if reach is not None:
            tap = torch.where(reach >= k - 1 - j, tap, 0.0)
        y = y + tap * w[:, j]
    return y


def gated_conv(z: torch.Tensor, weight: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
    """o = c * conv(b * x) for [b, c, x] = z (B, T, 3C) and the conv weight (C, k), zero-padded (and zero
    history at each document start of doc_start (B, T))."""
    b, c, x = z.chunk(3, dim=-1)
    return c * causal_conv(F.pad(b * x, (0, 0, weight.shape[1] - 1, 0)), weight, doc_start)


def gated_conv_backward_reference(
    u: torch.Tensor,
    do: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dz, o, column sums of dz, dw) for z = u + bias, u (B, T, 3C), bias (3C,) or None, do (B, T, C), the
    conv weight (C, k) and doc_start (B, T) or None. Computes in fp32 (fp64 for fp64 input); dz and o come
    back in u's dtype, the sums and dw in the compute dtype."""
    check_doc_start(doc_start, u.shape[0], u.shape[1])
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    z = u.to(compute) if bias is None else u.to(compute) + bias.to(compute)
    w = weight.to(compute)
    k, T = w.shape[1], z.shape[1]
    b, c, x = z.chunk(3, dim=-1)
    p = F.pad(b * x, (0, 0, k - 1, 0))
    y = causal_conv(p, w, doc_start)
    do = do.to(compute)
    if doc_start is None:
        dy = F.pad(do * c, (0, 0, 0, k - 1))
        dp = sum(dy[:, k - 1 - j : k - 1 - j + T] * w[:, j] for j in range(k))
        dw = torch.stack([(dy[:, :T] * p[:, j : j + T]).sum((0, 1)) for j in range(k)], dim=-1)
    else:
        reach = _reach(doc_start, k)
        # dy[t] as tap j of output t sees it: zero where that tap reads before t's document start
        dy_by_tap = [torch.where(reach >= k - 1 - j, do * c, 0.0) for j in range(k)]
        dp = sum(
            F.pad(dy_j, (0, 0, 0, k - 1))[:, k - 1 - j : k - 1 - j + T] * w[:, j] for j, dy_j in enumerate(dy_by_tap)
        )
        dw = torch.stack([(dy_j * p[:, j : j + T]).sum((0, 1)) for j, dy_j in enumerate(dy_by_tap)], dim=-1)
    dz = torch.cat([dp * x, do * y, dp * b], dim=-1)
    return dz.to(u.dtype), (c * y).to(u.dtype), dz.sum((0, 1)), dw
