"""Small building blocks shared by the ATMA blocks: RMSNorm, causal depthwise convolution, RoPE, MLP.

The convolution and RoPE also continue a sequence during generation: the convolution takes its last
k - 1 inputs from a state (instead of zero padding) and RoPE takes the tokens' absolute positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atma_titan.kernels.backends import gradients_flow
from atma_titan.kernels.glu import check_kind, glu, glu_backward
from atma_titan.kernels.short_conv import causal_conv


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMS-normalise the last dimension in fp32 (no learned weight); returns x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class CausalDepthwiseConv(nn.Module):
    """y[t, c] = sum_j w[c, j] x[t - (k-1) + j, c]: left-padded, per channel, no bias.

    The weight is stored as a (channels, kernel) matrix so Muon treats it like any block matrix.
    """

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, kernel))
        self.reset_parameters()

    def forward(self, x: torch.Tensor, state=None, doc_start=None) -> torch.Tensor:  # x: (B, T, C)
        """`state` (generation): a view of the sequences' last k - 1 inputs (B, k - 1, C) with read() and
        write(); they stand in for the zero padding and are replaced by the new last k - 1 inputs.
        `doc_start` (training, documents kept apart): no output reads an input before its document's start."""
        k = self.kernel
        if state is None:
            padded = F.pad(x, (0, 0, k - 1, 0))
        else:
            padded = torch.cat([state.read().to(x.dtype), x], dim=1)
            state.write(padded[:, padded.shape[1] - (k - 1) :])
        return causal_conv(padded, self.weight, doc_start)

    def reset_parameters(self) -> None:
        # nn.Conv1d's default for a depthwise kernel: U(-1/sqrt(k), 1/sqrt(k)).
        bound = self.kernel**-0.5
        nn.init.uniform_(self.weight, -bound, bound)


def rotary(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding on (B, T, H, D), rotating the two halves of D.

    positions: the tokens' absolute positions (B, T); None means 0..T-1 for every sequence.
    """
    T, D = x.shape[1], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D // 2, device=x.device, dtype=torch.float32) / (D // 2))
    if positions is None:
        positions = torch.arange(T, device=x.device)[None, :]
    angles = positions.float()[..., None] * inv_freq  # (B or 1, T, D/2)
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def fused_linear(x: torch.Tensor, linears: list[nn.Linear]) -> list[torch.Tensor]:
    """Each of `linears` applied to x, as one matrix product with their weights (and biases) stacked: the
    backward then takes x's gradient in one product too, not one per projection summed up. The
    parameters stay apart (their own optimizer treatment and checkpoint keys); the stacked copy of them is
    made in every call (small: a d x sum(widths) matrix)."""
    weight = torch.cat([linear.weight for linear in linears])
    bias = torch.cat([linear.bias for linear in linears])
    return list(F.linear(x, weight, bias).split([linear.out_features for linear in linears], dim=-1))


class MLP(nn.Module):
    """GLU MLP: `[a, g] = fc(x)`; relu2: `proj(g * relu(a)^2)`; swiglu: `proj(g * silu(a))`.

    When gradients flow, the backward is `_GLUMLP`'s: one pass over [a, g] and dh (atma_titan.kernels.glu,
    by `impl`) gives the GLU's gradient, h for proj's weight gradient and fc's bias gradient.
    """

    def __init__(self, d_model: int, hidden: int, kind: str = "relu2", impl: str = "auto"):
        super().__init__()
        check_kind(kind)
        self.kind, self.impl = kind, impl
        self.fc = nn.Linear(d_model, 2 * hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gradients_flow(x, self.fc.weight, self.fc.bias, self.proj.weight, self.proj.bias):
            # fc's matmul stays outside the Function, where activation checkpointing sees it (and may
            # recompute it); its bias is added inside, so the GLU pass also gives the bias gradient.
            u = F.linear(x, self.fc.weight)
            return _GLUMLP.apply(u, self.fc.bias, self.proj.weight, self.proj.bias, self.kind, self.impl)
        return self.proj(glu(self.fc(x), self.kind))


class _GLUMLP(torch.autograd.Function):
    """proj(glu(u + b_fc)) for u = x @ W_fc^T, with a hand-written backward, so that h is neither saved nor
    recomputed apart:

        dh = dout @ W_proj;  (du, h, db_fc) = glu_backward(u, dh, b_fc);  dW_proj = dout^T h

    and autograd takes du back through fc's matmul. Only u is saved, which selective AC keeps (a matmul's
    output) and full AC recomputes: ops inside an autograd.Function are not tagged for recomputation by
    a compiled checkpoint, so the Function holds no matmul of its own that the backward needs. The
    matmuls run in u's dtype: under autocast the forward's, as autograd's.
    """

    @staticmethod
    def forward(ctx, u, fc_bias, proj_weight, proj_bias, kind: str, impl: str):
        ctx.save_for_backward(u, fc_bias, proj_weight)
        ctx.kind, ctx.impl = kind, impl
        return F.linear(glu(u + fc_bias.to(u.dtype), kind), proj_weight, proj_bias)

    @staticmethod
    def backward(ctx, dout):
        u, fc_bias, proj_weight = ctx.saved_tensors
        dtype = u.dtype
        dout = dout.reshape(-1, dout.shape[-1]).to(dtype)
        du, h, fc_bias_grad = glu_backward(
            u.reshape(-1, u.shape[-1]),
            dout @ proj_weight.to(dtype),
            ctx.kind,
            fc_bias.to(dtype),
            impl=ctx.impl,
            what="model.mlp_impl",
        )
        return du.view(u.shape), fc_bias_grad.to(fc_bias.dtype), dout.t() @ h, dout.sum(0), None, None
