"""Muon's element-wise passes over many matrices (reference.py has the math), by impl
(auto | triton | reference, kernels/backends.py): on a GPU each pass is one Triton launch over every
matrix, where the PyTorch reference takes several foreach passes over the fp32 tensors.

Each matrix is 2-D; `grads`, `bufs` and `params` are contiguous fp32 of one shape per matrix,
`outs` / `updates` any strided view of that shape (a slot of a Newton-Schulz batch, a transposed one
included). Triton (triton_muon.py) is imported on the first kernel call.
"""

from __future__ import annotations

import torch

from atma_titan.kernels import backends
from atma_titan.kernels.muon_update.reference import apply_updates_reference_, stage_momentum_reference_

__all__ = ["apply_updates_", "stage_momentum_"]


def _kernels(tensors: list[torch.Tensor], impl: str, what: str):
    """The Triton module for fp32 matrices where `impl` takes the kernel, else None (the reference)."""
    if not tensors or tensors[0].dtype != torch.float32 or not backends.use_triton(impl, tensors[0].device, what):
        return None
    return backends.kernel_module(
        "atma_titan.kernels.muon_update.triton_muon",
        tensors[0].device,
        kernel="Muon's element-wise kernel",
        probe="_stage_kernel",
        reference="impl='reference'",
    )


def stage_momentum_(
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    outs: list[torch.Tensor],
    momentum: float,
    nesterov: bool,
    *,
    grad_scale: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
    impl: str = "auto",
    what: str = "impl",
) -> None:
    """Write each matrix's new momentum into its buffer (unless `skip`) and its update into `outs`
    (reference.py); `grad_scale` multiplies every gradient first, `skip` is read on the device."""
    kernels = _kernels(grads, impl, what)
    if kernels is None:
        return stage_momentum_reference_(grads, bufs, outs, momentum, nesterov, grad_scale, skip)
    kernels.stage_momentum_(grads, bufs, outs, momentum, nesterov, grad_scale, skip)


def apply_updates_(
    params: list[torch.Tensor],
    updates: list[torch.Tensor],
    decay: float,
    alphas: list[float],
    *,
    skip: torch.Tensor | None = None,
    impl: str = "auto",
    what: str = "impl",
) -> None:
    """Add alpha * update to each decayed parameter, unless `skip` (reference.py)."""
    kernels = _kernels(params, impl, what)
    if kernels is None:
        return apply_updates_reference_(params, updates, decay, alphas, skip)
    kernels.apply_updates_(params, updates, decay, alphas, skip)
