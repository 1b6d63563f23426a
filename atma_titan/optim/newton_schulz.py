"""Newton-Schulz orthogonalisation of Muon's updates, batched: the matrices of one shape (the small ones
zero-padded to one shape) share a stack, so a step launches a few dozen kernels, not thousands."""

from __future__ import annotations

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz, as in torch.optim.Muon
MAX_BATCH_ELEMENTS = 1 << 28  # matrices stacked into one Newton-Schulz batch: at most 512 MB of bf16


def orthogonalize(
    update: torch.Tensor, steps: int, eps: float = 1e-7, compute_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Newton-Schulz approximation of U V^T for update = U S V^T, returned in bf16.

    `update` is one matrix (rows, cols) or a stack of them (n, rows, cols), each orthogonalised on its own.
    The iteration runs on the short side's Gram matrix. A tall matrix is worked on as it lies: its Gram
    matrix is x^T x and the polynomial multiplies x from the right (x^T's iteration, transposed), so the
    products read no transposed copy and the result comes out in the input's layout.

    The products run in `compute_dtype`, by default bf16 on a GPU (torch.optim.Muon's recipe, bit for bit)
    and fp32 on the CPU, where bf16 matrix products have no fast kernel on most machines: in bf16 they
    took 55% of a debug-model training step on a 2-core CPU, and the step ran 2.4x faster in fp32."""
    a, b, c = NS_COEFFICIENTS
    if compute_dtype is None:
        compute_dtype = torch.float32 if update.device.type == "cpu" else torch.bfloat16
    x = update.to(compute_dtype)
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    tall = x.size(-2) > x.size(-1)
    fused = torch.baddbmm if x.dim() == 3 else torch.addmm  # input * beta + alpha * (m1 @ m2)
    for _ in range(steps):
        gram = x.mT @ x if tall else x @ x.mT
        poly = fused(gram, gram, gram, beta=b, alpha=c)  # symmetric: x^T's left product is x's right one
        x = fused(x, x, poly, beta=a) if tall else fused(x, poly, x, beta=a)
    return x.bfloat16()


# Matrices at most this small (short side, long side) are launch-bound: each Newton-Schulz product takes
# a kernel launch whatever its size. They are zero-padded to this one shape and share a batch (below).
SMALL_MATRIX = (32, 1024)


def batch_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) shape a matrix is orthogonalised at in orthogonalize_all(): its own, or, for a small
    one, SMALL_MATRIX (wide) with the matrix turned wide in its corner.

    Zero rows and columns leave the others' Newton-Schulz result as it is (the Gram matrix gains zero rows
    and columns, every product keeps them zero), so a padded matrix is cut back to its own result."""
    rows, cols = shape[-2:]
    if min(rows, cols) <= SMALL_MATRIX[0] and max(rows, cols) <= SMALL_MATRIX[1]:
        return SMALL_MATRIX
    return rows, cols


class UpdateBatches:
    """bf16 Newton-Schulz batches for matrices of the given shapes, one per batch_shape() (capped at
    MAX_BATCH_ELEMENTS): a model has a few shapes repeated over its blocks (the small ones all together),
    so a step launches a few dozen kernels, not thousands.

    `slots[i]` is matrix i's place in its batch, a view of the matrix's own shape (a small tall one turned
    wide, zero-padded around), where its update is written: by one multi-tensor cast copy
    (orthogonalize_all) or by Muon's element-wise kernel. A tall matrix is not turned (see orthogonalize()):
    transposing copies of the large tall matrices, in and out, were slow strided kernels on the GPU.
    `orthogonalize()` returns each matrix's bf16 result of its own shape, laid out as a contiguous matrix
    except for a small one's (a view into its padded batch).

    Every matrix goes through the batched (3-D) products, a lone one as a batch of one, so the kernels a
    matrix meets do not depend on which other matrices share its batch, and each batch entry is its own
    product: a matrix's result does not depend on its company (tested on CPU). The owner of a matrix under
    sharded Muon batches other matrices than a single process does and so gets the same bits. A GPU BLAS
    may pick another algorithm for another batch count; `benchmarks/train/muon_ownership.py --batch-invariance`
    checks that on the device."""

    def __init__(self, shapes: list[tuple[int, int]], device: torch.device):
        self.slots: list[torch.Tensor] = [None] * len(shapes)  # type: ignore[list-item]
        self._batches = []  # (batch, [(matrix, turned, rows, cols)])
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, shape in enumerate(shapes):
            by_shape.setdefault(batch_shape(shape), []).append(i)
        for (rows, cols), indices in by_shape.items():
            per_batch = max(1, MAX_BATCH_ELEMENTS // (rows * cols))  # bounds the stacked copies' memory
            for first in range(0, len(indices), per_batch):
                members = []
                for i in indices[first : first + per_batch]:
                    r, c = shapes[i][-2:]
                    # Only a small matrix is turned (to fit the wide SMALL_MATRIX) or padded; zeros only then.
                    turned = (rows, cols) == SMALL_MATRIX and r > c
                    members.append((i, turned, *((c, r) if turned else (r, c))))
                padded = any((r, c) != (rows, cols) for _, _, r, c in members)
                make = torch.zeros if padded else torch.empty  # no memset of a batch the copy fills
                batch = make((len(members), rows, cols), dtype=torch.bfloat16, device=device)
                for slot, (i, turned, r, c) in zip(batch.unbind(0), members):
                    self.slots[i] = slot[:r, :c].mT if turned else slot[:r, :c]
                self._batches.append((batch, members))

    def orthogonalize(self, steps: int, eps: float) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [None] * len(self.slots)  # type: ignore[list-item]
        for batch, members in self._batches:
            for (i, turned, r, c), x in zip(members, orthogonalize(batch, steps, eps).unbind(0)):
                out[i] = x[:r, :c].mT if turned else x[:r, :c]
        return out


def orthogonalize_all(updates: list[torch.Tensor], steps: int, eps: float) -> list[torch.Tensor]:
    """orthogonalize() of every matrix, in bf16, batched by UpdateBatches (one multi-tensor cast copy of the
    updates, each in its own layout, into their slots); each result is a bf16 tensor of its update's shape."""
    if not updates:
        return []
    batches = UpdateBatches([tuple(u.shape) for u in updates], updates[0].device)
    torch._foreach_copy_(batches.slots, updates)
    return batches.orthogonalize(steps, eps)


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> int:
    """FLOPs (2 per multiply-add) of orthogonalize() on one (rows, cols) matrix: per iteration, with
    s = min(rows, cols) and l = max, the Gram matrix (2 s^2 l), its square (2 s^3) and the product
    with x (2 s^2 l)."""
    s, l = sorted(shape[-2:])
    return steps * (4 * s * s * l + 2 * s**3)
