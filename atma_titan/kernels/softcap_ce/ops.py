"""The soft-capped cross-entropy over rows of logits: `softcap_ce_forward` and `softcap_ce_backward_`,
by impl (auto | triton | reference, kernels/backends.py).

No torch.library registration: the caller (the LM head's fused loss) is itself one custom op, opaque
to torch.compile, and calls these eagerly. Triton (triton_ce.py) is imported on the first kernel call.
"""

from __future__ import annotations

import torch

from atma_titan.kernels import backends
from atma_titan.kernels.softcap_ce.reference import softcap_ce_backward_reference, softcap_ce_forward_reference

__all__ = ["softcap_ce_forward", "softcap_ce_backward_", "kernel_runs"]


def kernel_runs(logits_dtype: torch.dtype, device: torch.device, impl: str, what: str) -> bool:
    """Whether `impl` takes the Triton kernel for logits of this dtype on `device`: it computes in fp32,
    so auto keeps fp64 logits (the fp64 tests) on the reference."""
    if impl == "auto" and logits_dtype == torch.float64:
        return False
    return backends.use_triton(impl, device, what)


def _kernels(device: torch.device):
    return backends.kernel_module(
        "atma_titan.kernels.softcap_ce.triton_ce",
        device,
        kernel="the soft-capped cross-entropy kernel",
        probe="_ce_rows_kernel",
        reference="impl='reference'",
    )


def softcap_ce_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    cap: float,
    *,
    impl: str = "auto",
    what: str = "impl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, log-sum-exp per row) of (M, V) logits against targets (M,) (< 0: ignored) weighted by
    scale (M,); fp32 from the kernel, fp32 / fp64 from the reference."""
    if kernel_runs(logits.dtype, logits.device, impl, what):
        return _kernels(logits.device).softcap_ce_forward(logits, targets, scale.float(), cap)
    return softcap_ce_forward_reference(logits, targets, scale, cap)


def softcap_ce_backward_(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    cap: float,
    *,
    bias_grad: bool = False,
    impl: str = "auto",
    what: str = "impl",
) -> torch.Tensor | None:
    """Overwrite `logits` with the gradient of the summed loss (in the logits' dtype); return its column
    sums in fp32 / fp64 (the bias gradient) if `bias_grad`, else None."""
    if kernel_runs(logits.dtype, logits.device, impl, what):
        return _kernels(logits.device).softcap_ce_backward_(logits, lse, targets, scale.float(), cap, bias_grad)
    grad = softcap_ce_backward_reference(logits, lse, targets, scale, cap)
    logits.copy_(grad)
    return grad.sum(0) if bias_grad else None
