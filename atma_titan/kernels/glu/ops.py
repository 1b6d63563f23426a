"""The MLP's GLU backward by impl (auto | triton | reference, kernels/backends.py), and its torch.library op.

    atma::glu_backward(u, dh, bias?, kind) -> (dfc, h, bias_grad)

A custom_op, opaque to torch.compile (as the other kernels' ops, it compiles with fullgraph=True on CUDA
and on CPU); the reference is plain PyTorch, which Inductor fuses where it runs compiled. Triton
(triton_glu.py) is imported on the first kernel call.
"""

from __future__ import annotations

from typing import Optional

import torch

from atma_titan.kernels import backends
from atma_titan.kernels.glu.reference import check_kind, glu_backward_reference

__all__ = ["glu_backward"]


def _kernels(device: torch.device):
    return backends.kernel_module(
        "atma_titan.kernels.glu.triton_glu",
        device,
        kernel="the GLU backward kernel",
        probe="_glu_bwd_kernel",
        reference="impl='reference'",
    )


@torch.library.custom_op("atma::glu_backward", mutates_args=())
def _glu_backward_op(
    u: torch.Tensor, dh: torch.Tensor, bias: Optional[torch.Tensor], kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernels(u.device).glu_backward(u, dh, kind, bias)


@_glu_backward_op.register_fake
def _glu_backward_fake(u, dh, bias, kind):
    return torch.empty_like(u), torch.empty_like(dh), u.new_empty(u.shape[-1], dtype=torch.float32)


def glu_backward(
    u: torch.Tensor,
    dh: torch.Tensor,
    kind: str,
    bias: torch.Tensor | None = None,
    *,
    impl: str = "auto",
    what: str = "impl",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dfc, h, column sums of dfc) for fc = u + bias, u (M, 2N), bias (2N,) or None, and dh (M, N)
    (reference.py). The Triton kernel takes bf16 / fp16 / fp32 and returns the sums in fp32; auto keeps
    fp64 (the tests) on the reference."""
    check_kind(kind)
    if not (impl == "auto" and u.dtype == torch.float64) and backends.use_triton(impl, u.device, what):
        bias = None if bias is None else bias.contiguous()
        return torch.ops.atma.glu_backward(u.contiguous(), dh.contiguous(), bias, kind)
    return glu_backward_reference(u, dh, kind, bias)
