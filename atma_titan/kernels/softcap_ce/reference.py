"""PyTorch reference of the soft-capped cross-entropy over rows of logits (the ground truth of the kernel).

For a row z of V logits, its target t (< 0: ignored) and its weight w:

    s = softcap(z) = c z / sqrt(z^2 + c^2)          (c = 0: s = z)
    lse = log sum_j exp(s_j),   loss = w (lse - s_t)
    d loss / d z_j = w (softmax(s)_j - [j = t]) (c / sqrt(z_j^2 + c^2))^3

Computed in fp32 (fp64 for fp64 logits), out of place: clarity over memory.
"""

from __future__ import annotations

import torch


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """z <- c z / sqrt(z^2 + c^2): smooth, odd, bounded by c, ~identity near zero (c = 0: unchanged)."""
    if not cap:
        return logits
    return cap * logits * torch.rsqrt(logits.square() + cap * cap)


def _math(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
    acc = torch.promote_types(logits.dtype, torch.float32)
    valid = targets >= 0
    return logits.to(acc), valid, torch.where(valid, targets, 0).unsqueeze(1), torch.where(valid, scale.to(acc), 0)


def softcap_ce_forward_reference(
    logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, log-sum-exp per row) of (M, V) logits, targets (M,) and weights (M,), in fp32 / fp64."""
    z, valid, safe, w = _math(logits, targets, scale)
    s = softcap(z, cap)
    lse = torch.logsumexp(s, dim=-1)
    return torch.where(valid, (lse - s.gather(1, safe).squeeze(1)) * w, 0.0), lse


def softcap_ce_backward_reference(
    logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, cap: float
) -> torch.Tensor:
    """d (summed loss) / d logits, in fp32 / fp64 (the log-sum-exp from the forward)."""
    z, _, safe, w = _math(logits, targets, scale)
    s = softcap(z, cap)
    g = (s - lse.unsqueeze(1)).exp() * w.unsqueeze(1)
    g = g.scatter_add(1, safe, -w.unsqueeze(1))
    if cap:
        g = g * (cap * torch.rsqrt(z.square() + cap * cap)) ** 3
    return g
