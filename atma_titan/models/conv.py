"""LFM2 gated short convolution, the mixer of the local blocks (docs/model.md section 2).

    B, C, x = split3(in_proj(h));  y = causal_depthwise_conv1d(B * x, k=3);  out = out_proj(C * y)

No nonlinearity: the input gate B and output gate C make it a data-dependent, strictly local filter.
When gradients flow, the backward is `_GatedConv`'s: one pass over in_proj's output and out_proj's input
gradient (atma_titan.kernels.short_conv, by `model.conv_impl`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atma_titan.kernels.backends import gradients_flow
from atma_titan.kernels.short_conv import gated_conv, gated_conv_backward
from atma_titan.models.flavors import ModelArgs
from atma_titan.models.layers import CausalDepthwiseConv


class GatedShortConv(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d = args.d_model
        self.impl = args.conv_impl
        self.in_proj = nn.Linear(d, 3 * d)
        self.conv = CausalDepthwiseConv(d, args.conv_kernel)
        self.out_proj = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, cache=None, doc_start=None) -> tuple[torch.Tensor, None]:
        """cache (generation): the block's `atma_titan.inference` LayerCache, holding the conv state.
        doc_start (training, documents kept apart): the convolution does not read across a document start."""
        weights = (self.in_proj.weight, self.in_proj.bias, self.conv.weight, self.out_proj.weight, self.out_proj.bias)
        if cache is None and gradients_flow(h, *weights):
            # in_proj's matmul stays outside the Function, where activation checkpointing sees it (and may
            # recompute it); its bias is added inside, so the one backward pass also gives the bias gradient.
            u = F.linear(h, self.in_proj.weight)
            return _GatedConv.apply(u, *weights[1:], self.impl, doc_start), None
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        state = None if cache is None else cache.state("conv")
        return self.out_proj(c * self.conv(b * x, state, doc_start)), None

    def zero_output(self) -> None:
        nn.init.zeros_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)


class _GatedConv(torch.autograd.Function):
    """out_proj(c * conv(b * x)) for [b, c, x] = u + b_in, u = h @ W_in^T, with a hand-written backward:

        do = dout @ W_out;  (du, o, db_in, dw_conv) = gated_conv_backward(u, do, w_conv, b_in);  dW_out = dout^T o

    and autograd takes du back through in_proj's matmul. As in the MLP's `_GLUMLP` (models/layers.py), only
    inputs are saved: a compiled checkpoint does not tag ops inside an autograd.Function for recomputation,
    so the Function holds no matmul of its own that the backward needs. The matmuls run in u's dtype.
    """

    @staticmethod
    def forward(ctx, u, in_bias, conv_weight, out_weight, out_bias, impl: str, doc_start):
        ctx.save_for_backward(u, in_bias, conv_weight, out_weight, doc_start)
        ctx.impl = impl
        return F.linear(gated_conv(u + in_bias.to(u.dtype), conv_weight, doc_start), out_weight, out_bias)

    @staticmethod
    def backward(ctx, dout):
        u, in_bias, conv_weight, out_weight, doc_start = ctx.saved_tensors
        dtype = u.dtype
        dout = dout.to(dtype)
        do = dout @ out_weight.to(dtype)
        du, o, in_bias_grad, conv_grad = gated_conv_backward(
            u, do, conv_weight.to(dtype), in_bias.to(dtype), doc_start, impl=ctx.impl, what="model.conv_impl"
        )
        dout, o = dout.reshape(-1, dout.shape[-1]), o.reshape(-1, o.shape[-1])
        out_weight_grad = dout.t() @ o
        conv_grad = conv_grad.to(conv_weight.dtype)
        return du, in_bias_grad.to(in_bias.dtype), conv_grad, out_weight_grad, dout.sum(0), None, None
