"""Polar attention: one entry point, `polar_attention(..., impl=auto | triton | reference)`.

- reference.py: the PyTorch references, `polar_attention_naive` (materialised weights, autograd
  backward; ground truth) and `polar_attention_reference` (streaming tiles, the form the kernel mirrors).
- ops.py: the torch.library custom ops of the fused kernel, `polar_attention_triton` (the kernel alone)
  and the dispatching `polar_attention`.
- triton_attention.py: the Triton kernels and their launchers.
- decode.py: one query per sequence over a paged KV cache: the custom op `atma::polar_decode`,
  `polar_decode_triton` (the kernel alone) and the dispatching `polar_decode`; triton_decode.py holds
  the split-KV Triton kernels, reference.py `polar_decode_reference`.

Packed documents: `doc_start=` (kernels/documents.py) on the attention entry points keeps each query inside
its own document (reference.py says how); decode has one document per sequence.

Triton is imported on the first kernel call, so this package imports on machines without triton.
"""

from atma_titan.kernels.polar.decode import polar_decode, polar_decode_triton
from atma_titan.kernels.polar.ops import polar_attention, polar_attention_triton, supports_head_dim
from atma_titan.kernels.polar.reference import (
    polar_attention_naive,
    polar_attention_reference,
    polar_decode_reference,
    polar_scalars,
)

__all__ = [
    "polar_attention",
    "polar_attention_naive",
    "polar_attention_reference",
    "polar_attention_triton",
    "polar_decode",
    "polar_decode_reference",
    "polar_decode_triton",
    "polar_scalars",
    "supports_head_dim",
]
