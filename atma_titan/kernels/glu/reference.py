"""The math of the MLP's gated linear unit (docs/model.md section 1), in PyTorch.

    [a, g] = fc                 the up-projection's output, split into halves (the backward takes it
                                without its bias and the bias apart: fc = u + bias)
    h = g * act(a)              act: relu2 = relu(a)^2, swiglu = silu(a)

and its backward, given dh = dL/dh:

    dg = dh * act(a)            da = dh * g * act'(a)       act': relu2 2 relu(a), swiglu s (1 + a (1 - s))
    bias gradient of fc = the column sums of [da, dg]

The backward also returns h again: the down-projection's weight gradient needs it, and recomputing it
in the same pass over [a, g] costs one more write instead of a second read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["GLU_KINDS", "check_kind", "glu", "glu_backward_reference"]

GLU_KINDS = ("relu2", "swiglu")


def check_kind(kind: str) -> None:
    if kind not in GLU_KINDS:
        raise ValueError(f"GLU kind {kind!r} is unknown; allowed: {', '.join(GLU_KINDS)}")


def glu(fc: torch.Tensor, kind: str) -> torch.Tensor:
    """h = g * act(a) for [a, g] = fc split on its last dimension."""
    check_kind(kind)
    a, g = fc.chunk(2, dim=-1)
    return g * (F.relu(a).square() if kind == "relu2" else F.silu(a))


def glu_backward_reference(
    u: torch.Tensor, dh: torch.Tensor, kind: str, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dfc, h, column sums of dfc) for fc = u + bias, u (M, 2N), bias (2N,) or None, and dh (M, N).
    Computes in fp32 (fp64 for fp64 input); dfc and h come back in u's dtype, the sums in the compute dtype."""
    check_kind(kind)
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    fc = u.to(compute) if bias is None else u.to(compute) + bias.to(compute)
    a, g = fc.chunk(2, dim=-1)
    dh = dh.to(compute)
    if kind == "relu2":
        r = F.relu(a)
        act, dact = r * r, 2 * r
    else:
        s = torch.sigmoid(a)
        act, dact = a * s, s * (1 + a * (1 - s))
    dfc = torch.cat([dh * g * dact, dh * act], dim=-1)
    return dfc.to(u.dtype), (g * act).to(u.dtype), dfc.sum(0)
