"""The LFM2 block's gated short convolution: its forward in PyTorch, and its backward fused into one pass.
Each takes an optional `doc_start` (kernels/documents.py): the convolution then reads nothing before a
token's document start.

- reference.py: the math (`causal_conv`, `gated_conv`, `gated_conv_backward_reference`), in PyTorch.
- ops.py: `gated_conv_backward` by impl (auto | triton | reference), and the torch.library op it calls.
- triton_short_conv.py: the Triton backward kernel and its launcher, imported on the first kernel call.
"""

from atma_titan.kernels.short_conv.ops import gated_conv_backward
from atma_titan.kernels.short_conv.reference import causal_conv, gated_conv, gated_conv_backward_reference

__all__ = ["causal_conv", "gated_conv", "gated_conv_backward", "gated_conv_backward_reference"]
