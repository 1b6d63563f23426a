"""The math of Muon's element-wise passes, in PyTorch (foreach ops), for matrices of any float dtype.

Per matrix, with momentum mu, the gradient scale s (the clip's coefficient; 1 when not given) and the
step's skip flag (a scalar on the device, non-zero where the step must not update; none: always update):
    stage:  g = s * grad
            m = lerp(buf, g, 1 - mu)               the new momentum, written into `buf` unless skipped
            out = lerp(g, m, mu) (Nesterov) or m,  cast to `out`'s dtype (Newton-Schulz's input)
    apply:  param = param * decay + alpha * update  unless skipped  (decay = 1 - lr * weight decay)

Both passes read the skip flag on the device, so a step is queued whole before the host knows whether it
may update: a skipped one leaves buffers and parameters as they were, bit for bit, whatever the gradients
held (NaN included: the flag selects, it does not multiply). `grad` itself is left as it was.
"""

from __future__ import annotations

import torch

__all__ = ["apply_updates_reference_", "stage_momentum_reference_"]


def _skipped_on_host(skip: torch.Tensor | None) -> bool | None:
    """Whether the step is skipped, where the host can tell without a sync (no flag, or one in host memory);
    None where the flag lives on a GPU and the passes must select on the device."""
    if skip is None:
        return False
    return bool(skip) if skip.device.type == "cpu" else None


def _write_unless_skipped_(dsts: list[torch.Tensor], srcs: list[torch.Tensor], skip: torch.Tensor | None) -> None:
    """dsts[i] = srcs[i], unless `skip` is non-zero."""
    skipped = _skipped_on_host(skip)
    if skipped is None:
        on_device = skip != 0
        for dst, src in zip(dsts, srcs):
            dst.copy_(torch.where(on_device, dst, src))
    elif not skipped:
        torch._foreach_copy_(dsts, srcs)


def stage_momentum_reference_(
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    outs: list[torch.Tensor],
    momentum: float,
    nesterov: bool,
    grad_scale: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
) -> None:
    if grad_scale is not None:
        grads = torch._foreach_mul(grads, grad_scale)
    momenta = torch._foreach_lerp(bufs, grads, 1 - momentum)
    torch._foreach_copy_(outs, torch._foreach_lerp(grads, momenta, momentum) if nesterov else momenta)
    _write_unless_skipped_(bufs, momenta, skip)


def apply_updates_reference_(
    params: list[torch.Tensor],
    updates: list[torch.Tensor],
    decay: float,
    alphas: list[float],
    skip: torch.Tensor | None = None,
) -> None:
    skipped = _skipped_on_host(skip)
    if skipped:
        return
    new = params if skipped is not None else [p.clone() for p in params]  # selected into params on the device
    torch._foreach_mul_(new, decay)
    # One foreach add per distinct alpha (a model has a few aspect ratios), the update promoted inside the add.
    by_alpha: dict[float, list[int]] = {}
    for i, alpha in enumerate(alphas):
        by_alpha.setdefault(alpha, []).append(i)
    for alpha, members in by_alpha.items():
        torch._foreach_add_([new[i] for i in members], [updates[i] for i in members], alpha=alpha)
    if skipped is None:
        _write_unless_skipped_(params, new, skip)
