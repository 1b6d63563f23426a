"""Triton kernels of the soft-capped cross-entropy over rows of logits (reference.py has the math).

Two memory-bound passes over the (M, V) logits, which the LM-head matmul wrote in bf16:

- `_ce_rows_kernel`, one program per row: streams the row once for its log-sum-exp (running max and sum,
  one exp and one rsqrt per logit) and the target's logit; writes the row's loss and log-sum-exp.
- `_ce_grad_kernel`, one program per (column block, row group): reads its tile rows once more and writes
  the logits' gradient over the logits in place (the same dtype; nothing of size M x V is allocated), and
  the column sums of the fp32 gradient for its row group (the bias gradient, summed by the caller:
  deterministic, no atomics).

Each logit is read twice and written once, in bf16; the compiled PyTorch chunk makes an fp32 copy of
the logits and passes over it several times (on the H200 its element-wise work took ~1.6 ms a 5,336-token
chunk, these two kernels 0.51 ms). Targets must be < V: the trainer checks every token id before step 1
(data/token_range.py); a larger one is masked out of the loads, never read past its row. Configs are
fixed, not tuned: the kernels use no shared
memory beyond their reductions, so every config fits any GPU (benchmarks/kernels/kernel_resources.py lists
them), and the gradient kernel writes in place, which an autotuner's repeated trial launches would
corrupt. Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Measured on the H200 at M = 5,336 and V = 50,304 (the default chunk), medians of 20 launches:
# the row kernel 0.18 ms at 4,096 logits a step x 4 warps (2,048 or 8,192, 4 or 8 warps: 0.19-0.24 ms);
# the gradient kernel 0.33 ms at 16 x 128 tiles, 8 warps, 1,024 rows a program (16-64 rows x 64-256
# columns: 0.33-1.06 ms). Both move about 3 TB/s.
ROW_BLOCK, ROW_WARPS = 4096, 4
GRAD_ROWS, GRAD_COLS, GRAD_WARPS = 16, 128, 8
ROWS_PER_PROGRAM = 1024


@triton.jit
def _softcap(z, cap, HAS_CAP: tl.constexpr):
    """(softcap(z), c / sqrt(z^2 + c^2)), the second only meaningful with HAS_CAP."""
    if HAS_CAP:
        inv = cap * tl.math.rsqrt(z * z + cap * cap)
        return z * inv, inv
    return z, z


@triton.jit
def _ce_rows_kernel(
    logits_ptr, stride, targets_ptr, scale_ptr, lse_ptr, loss_ptr, V, cap,
    HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    offsets = tl.arange(0, BLOCK)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offsets
        z = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        s, _ = _softcap(z, cap, HAS_CAP)
        s = tl.where(cols < V, s, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(s, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(s - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target = tl.load(targets_ptr + row)
    valid = target >= 0
    s_target, _ = _softcap(tl.load(base + target, mask=valid & (target < V), other=0.0).to(tl.float32), cap, HAS_CAP)
    loss = tl.where(valid, (lse - s_target) * tl.load(scale_ptr + row), 0.0)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, loss)


@triton.jit
def _ce_grad_kernel(
    logits_ptr, stride, targets_ptr, scale_ptr, lse_ptr, bias_part_ptr, M, V, rows_per_program, cap,
    HAS_CAP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    col_block, group = tl.program_id(0), tl.program_id(1)
    cols = col_block * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    column_sum = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)  # reduced over rows once, after the loop
    first = group * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < last
        mask = row_ok[:, None] & col_ok[None, :]
        ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :]
        z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        target = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        scale = tl.where(target >= 0, scale, 0.0)  # ignored rows (and those past the end) have no gradient
        s, inv = _softcap(z, cap, HAS_CAP)
        g = tl.exp(s - lse[:, None]) * scale[:, None]
        g = tl.where(cols[None, :] == target[:, None], g - scale[:, None], g)
        if HAS_CAP:
            g = g * (inv * inv * inv)
        g = tl.where(mask, g, 0.0)
        tl.store(ptrs, g.to(logits_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            column_sum += g
    if HAS_BIAS:
        tl.store(bias_part_ptr + group.to(tl.int64) * V + cols, tl.sum(column_sum, axis=0), mask=col_ok)


def _check(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> None:
    if logits.ndim != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (rows, vocab) with contiguous rows, got {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1] or scale.shape != logits.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} and scale {tuple(scale.shape)} must be ({logits.shape[0]},)")
    if scale.dtype != torch.float32 or not targets.is_contiguous() or not scale.is_contiguous():
        raise ValueError("targets must be contiguous and scale a contiguous fp32 tensor")


def softcap_ce_forward(
    logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, log-sum-exp per row), fp32, of (M, V) logits; targets < 0 are ignored."""
    _check(logits, targets, scale)
    m, v = logits.shape
    lse = torch.empty(m, dtype=torch.float32, device=logits.device)
    loss = torch.empty_like(lse)
    if m:
        _ce_rows_kernel[(m,)](
            logits, logits.stride(0), targets, scale, lse, loss, v, float(cap),
            HAS_CAP=bool(cap), BLOCK=min(ROW_BLOCK, triton.next_power_of_2(v)), num_warps=ROW_WARPS,
        )  # fmt: skip
    return loss, lse


def softcap_ce_backward_(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    cap: float,
    bias_grad: bool,
    rows_per_program: int = ROWS_PER_PROGRAM,
) -> torch.Tensor | None:
    """Overwrite `logits` with d (summed loss) / d logits; return the column sums (fp32) if `bias_grad`."""
    _check(logits, targets, scale)
    m, v = logits.shape
    rows_per_program = triton.cdiv(rows_per_program, GRAD_ROWS) * GRAD_ROWS  # whole tiles per program
    groups = triton.cdiv(m, rows_per_program)
    parts = torch.empty((groups, v) if bias_grad else (0,), dtype=torch.float32, device=logits.device)
    if m:
        _ce_grad_kernel[(triton.cdiv(v, GRAD_COLS), groups)](
            logits, logits.stride(0), targets, scale, lse, parts, m, v, rows_per_program, float(cap),
            HAS_CAP=bool(cap), HAS_BIAS=bias_grad, BLOCK_M=GRAD_ROWS, BLOCK_V=GRAD_COLS, num_warps=GRAD_WARPS,
        )  # fmt: skip
    if not bias_grad:
        return None
    return parts.sum(0) if m else parts.new_zeros(v)
