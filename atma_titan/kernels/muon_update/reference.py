"""The math of Muon's element-wise passes, in PyTorch (foreach ops), for matrices of any float dtype.

Per matrix, with momentum mu:
    stage:  m = lerp(buf, grad, 1 - mu)            the new momentum, written over `grad` (scratch)
            out = lerp(grad, m, mu) (Nesterov) or m, cast to `out`'s dtype (Newton-Schulz's input)
    apply:  buf = m;  param = param * decay + alpha * update    (decay = 1 - lr * weight decay)

The momentum buffer is only written by apply, so a step staged and then dropped leaves it as it was.
"""

from __future__ import annotations

import torch

__all__ = ["apply_updates_reference_", "stage_momentum_reference_"]


def stage_momentum_reference_(
    grads: list[torch.Tensor], bufs: list[torch.Tensor], outs: list[torch.Tensor], momentum: float, nesterov: bool
) -> None:
    momenta = torch._foreach_lerp(bufs, grads, 1 - momentum)
    if nesterov:
        torch._foreach_lerp_(grads, momenta, momentum)
        torch._foreach_copy_(outs, grads)
    else:
        torch._foreach_copy_(outs, momenta)
    torch._foreach_copy_(grads, momenta)


def apply_updates_reference_(
    params: list[torch.Tensor],
    bufs: list[torch.Tensor],
    momenta: list[torch.Tensor],
    updates: list[torch.Tensor],
    decay: float,
    alphas: list[float],
) -> None:
    torch._foreach_copy_(bufs, momenta)
    torch._foreach_mul_(params, decay)
    # One foreach add per distinct alpha (a model has a few aspect ratios), the update promoted inside the add.
    by_alpha: dict[float, list[int]] = {}
    for i, alpha in enumerate(alphas):
        by_alpha.setdefault(alpha, []).append(i)
    for alpha, members in by_alpha.items():
        torch._foreach_add_([params[i] for i in members], [updates[i] for i in members], alpha=alpha)
