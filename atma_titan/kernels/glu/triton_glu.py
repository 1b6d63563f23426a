"""The Triton kernel of the MLP's GLU backward (reference.py has the math).

`_glu_bwd_kernel`, one program per (column block, row group): reads its tiles of a and g (the
up-projection's matmul output; the bias, read once per program, is added here) and dh once, and writes da
and dg (the up-projection's output gradient), h (the down-projection's input, recomputed for its weight
gradient) and the column sums of [da, dg] for its row group (the up-projection's bias gradient, summed by
the caller: deterministic, no atomics). A memory-bound pass: 3 reads and 3 writes per hidden unit and
token in bf16, where autograd's compiled backward read [a, g] twice (once to recompute h, once to
differentiate) and reduced the bias gradient in a kernel of its own layout. No shared memory beyond the
column sums, so the one fixed config fits every GPU (benchmarks/kernels/kernel_resources.py lists it).
Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tiles of 32 rows x 128 columns, 8 warps, 2,048 rows a program: on the H200 at 32,768 x 4,096 the fastest
# config benchmarks/kernels/fused_backward.py tried in its first run (0.46 ms) and within 0.5% of the fastest in its
# second (0.49 ms, beside 1,024 rows); every config tried took 0.46-0.55 ms (3.9-4.7 TB/s).
BLOCK_M, BLOCK_N, NUM_WARPS = 32, 128, 8
ROWS_PER_PROGRAM = 2048


@triton.jit
def _glu_bwd_kernel(
    fc_ptr, bias_ptr, dh_ptr, dfc_ptr, h_ptr, part_ptr, M, N, rows_per_program,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    col_block, group = tl.program_id(0), tl.program_id(1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    sum_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # reduced over rows once, after the loop
    sum_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias_a = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        bias_g = tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    first = group * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for start in range(first, last, BLOCK_M):
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < last)[:, None] & col_ok[None, :]
        fc_at = rows[:, None] * (2 * N) + cols[None, :]  # a; g is N columns on
        at = rows[:, None] * N + cols[None, :]
        a = tl.load(fc_ptr + fc_at, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(fc_ptr + fc_at + N, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            a += bias_a
            g += bias_g
        if SWIGLU:
            s = tl.sigmoid(a)
            act = a * s
            dact = s * (1 + a * (1 - s))
        else:
            r = tl.maximum(a, 0.0)
            act = r * r
            dact = 2 * r
        da = dh * g * dact  # zero outside the mask: dh loads as 0 there
        dg = dh * act
        tl.store(dfc_ptr + fc_at, da.to(dfc_ptr.dtype.element_ty), mask=mask)
        tl.store(dfc_ptr + fc_at + N, dg.to(dfc_ptr.dtype.element_ty), mask=mask)
        tl.store(h_ptr + at, (g * act).to(h_ptr.dtype.element_ty), mask=mask)
        sum_a += da
        sum_g += dg
    part = part_ptr + group.to(tl.int64) * (2 * N) + cols
    tl.store(part, tl.sum(sum_a, axis=0), mask=col_ok)
    tl.store(part + N, tl.sum(sum_g, axis=0), mask=col_ok)


def _check(fc: torch.Tensor, dh: torch.Tensor, bias: torch.Tensor | None) -> None:
    if fc.ndim != 2 or fc.shape[1] % 2 or not fc.is_contiguous():
        raise ValueError(f"fc must be a contiguous (rows, 2 x hidden) matrix, got {tuple(fc.shape)}")
    if dh.shape != (fc.shape[0], fc.shape[1] // 2) or not dh.is_contiguous():
        raise ValueError(f"dh {tuple(dh.shape)} must be a contiguous ({fc.shape[0]}, {fc.shape[1] // 2}) matrix")
    if dh.dtype != fc.dtype:
        raise ValueError(f"fc ({fc.dtype}) and dh ({dh.dtype}) must share a dtype")
    if bias is not None and (bias.shape != fc.shape[1:] or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} must be a contiguous ({fc.shape[1]},) vector")


def glu_backward(
    fc: torch.Tensor, dh: torch.Tensor, kind: str, bias: torch.Tensor | None = None, rows_per_program: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dfc, h, column sums of dfc in fp32) for fc + bias, fc (M, 2N), bias (2N,) or None, dh (M, N)
    (reference.py)."""
    _check(fc, dh, bias)
    m, n = dh.shape
    rows_per_program = triton.cdiv(rows_per_program or ROWS_PER_PROGRAM, BLOCK_M) * BLOCK_M  # whole tiles
    groups = triton.cdiv(m, rows_per_program)
    dfc, h = torch.empty_like(fc), torch.empty_like(dh)
    parts = torch.empty((groups, 2 * n), dtype=torch.float32, device=fc.device)
    if m == 0:
        return dfc, h, parts.new_zeros(2 * n)
    _glu_bwd_kernel[(triton.cdiv(n, BLOCK_N), groups)](
        fc, fc if bias is None else bias, dh, dfc, h, parts, m, n, rows_per_program,
        HAS_BIAS=bias is not None, SWIGLU=kind == "swiglu", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
    )  # fmt: skip
    return dfc, h, parts.sum(0)
