"""LFM2 gated short convolution, the mixer of the local blocks (docs/model.md section 2).

    B, C, x = split3(in_proj(h));  y = causal_depthwise_conv1d(B * x, k=3);  out = out_proj(C * y)

No nonlinearity: the input gate B and output gate C make it a data-dependent, strictly local filter.
"""

from __future__ import annotations

import torch
from torch import nn

from atma_titan.models.flavors import ModelArgs
from atma_titan.models.layers import CausalDepthwiseConv


class GatedShortConv(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d = args.d_model
        self.in_proj = nn.Linear(d, 3 * d)
        self.conv = CausalDepthwiseConv(d, args.conv_kernel)
        self.out_proj = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, cache=None) -> tuple[torch.Tensor, None]:
        """cache (generation): the block's `atma_titan.inference` LayerCache, holding the conv state."""
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        state = None if cache is None else cache.state("conv")
        return self.out_proj(c * self.conv(b * x, state)), None

    def zero_output(self) -> None:
        nn.init.zeros_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)
