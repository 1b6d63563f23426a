"""The gated short convolution's backward by impl (auto | triton | reference, kernels/backends.py), and its
torch.library op.

    atma::gated_conv_backward(u, do, weight, bias?, doc_start?) -> (dz, o, bias_grad, weight_grad)

A custom_op, opaque to torch.compile (as the other kernels' ops); the reference is plain PyTorch, which
Inductor fuses where it runs compiled. Triton (triton_short_conv.py) is imported on the first kernel call.
"""

from __future__ import annotations

from typing import Optional

import torch

from atma_titan.kernels import backends
from atma_titan.kernels.documents import check_doc_start
from atma_titan.kernels.short_conv.reference import gated_conv_backward_reference

__all__ = ["MAX_KERNEL", "gated_conv_backward"]

MAX_KERNEL = 4  # the widest convolution the Triton kernel takes (it keeps one accumulator per tap)


def _kernels(device: torch.device):
    return backends.kernel_module(
        "atma_titan.kernels.short_conv.triton_short_conv",
        device,
        kernel="the gated short convolution's backward kernel",
        probe="_gated_conv_bwd_kernel",
        reference="impl='reference'",
    )


@torch.library.custom_op("atma::gated_conv_backward", mutates_args=())
def _gated_conv_backward_op(
    u: torch.Tensor,
    do: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    doc_start: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernels(u.device).gated_conv_backward(u, do, weight, bias, doc_start)


@_gated_conv_backward_op.register_fake
def _gated_conv_backward_fake(u, do, weight, bias, doc_start):
    sums = u.new_empty(u.shape[-1], dtype=torch.float32)
    return torch.empty_like(u), torch.empty_like(do), sums, weight.new_empty(weight.shape, dtype=torch.float32)


def gated_conv_backward(
    u: torch.Tensor,
    do: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
    *,
    impl: str = "auto",
    what: str = "impl",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dz, o, column sums of dz, dw) for z = u + bias, u (B, T, 3C), bias (3C,) or None, do (B, T, C), the
    conv weight (C, k) and doc_start (B, T) or None (kernels/documents.py; reference.py has the math). The
    Triton kernel takes bf16 / fp16 / fp32 and k <= 4, and returns the sums and dw in fp32; auto keeps fp64
    (the tests) and wider kernels on the reference."""
    check_doc_start(doc_start, u.shape[0], u.shape[1])
    keep_reference = impl == "auto" and (u.dtype == torch.float64 or weight.shape[-1] > MAX_KERNEL)
    if not keep_reference and backends.use_triton(impl, u.device, what):
        bias = None if bias is None else bias.contiguous()
        return torch.ops.atma.gated_conv_backward(u.contiguous(), do.contiguous(), weight.contiguous(), bias, doc_start)
    return gated_conv_backward_reference(u, do, weight, bias, doc_start)
