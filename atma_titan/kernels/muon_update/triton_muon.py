"""Triton kernels of Muon's element-wise passes (reference.py has the math).

Each pass is one launch over every matrix of a step (multi-tensor): a table on the device holds each
matrix's pointers, size, columns and the strides of its bf16 view, and each program takes BLOCK
elements of one matrix (a second table maps programs to (matrix, block)). The fp32 tensors are read
and written contiguously; the bf16 view is addressed by row and column, so it may be a padded or
transposed slot of a Newton-Schulz batch.

- `_stage_kernel`: reads gradient and buffer (and the gradient scale), writes the new momentum into the
  buffer and the update in bf16 (14 bytes an element; the foreach reference moves 38).
- `_apply_kernel`: reads the parameter and the bf16 update, writes the parameter (10 bytes), with one
  alpha per matrix.

Both read the step's skip flag from the device (when given) and then keep buffer and parameter as they
were: they select, so a NaN gradient cannot leak into a skipped step. The lerps are written as torch.lerp
computes them (weight < 0.5: a + w (b - a); else b - (b - a)(1 - w)). The kernels use no shared memory,
so every GPU fits them (benchmarks/kernels/kernel_resources.py). Importing this module imports triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK, WARPS = 2048, 8


@triton.jit
def _block(blocks_ptr, BLOCK: tl.constexpr):
    """(matrix index, the offsets of this program's elements in it)."""
    pid = tl.program_id(0)
    matrix = tl.load(blocks_ptr + 2 * pid).to(tl.int64)
    first = tl.load(blocks_ptr + 2 * pid + 1).to(tl.int64) * BLOCK
    return matrix, first + tl.arange(0, BLOCK)


@triton.jit
def _stage_kernel(
    table_ptr, blocks_ptr, scale_ptr, skip_ptr, one_minus_momentum, momentum,
    NESTEROV: tl.constexpr, SCALED: tl.constexpr, SKIPPABLE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    matrix, offs = _block(blocks_ptr, BLOCK)
    row = table_ptr + matrix * 7  # grad, buf, out pointers; numel, cols, out row and column strides
    grad = tl.load(row).to(tl.pointer_type(tl.float32))
    buf = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    out = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16))
    numel, cols = tl.load(row + 3), tl.load(row + 4)
    out_rs, out_cs = tl.load(row + 5), tl.load(row + 6)
    mask = offs < numel
    g = tl.load(grad + offs, mask=mask, other=0.0)
    if SCALED:
        g = g * tl.load(scale_ptr)
    b = tl.load(buf + offs, mask=mask, other=0.0)
    m = b + one_minus_momentum * (g - b)
    if NESTEROV:
        u = m - (m - g) * (1.0 - momentum)
    else:
        u = m
    if SKIPPABLE:
        m = tl.where(tl.load(skip_ptr) != 0, b, m)
    tl.store(buf + offs, m, mask=mask)
    tl.store(out + (offs // cols) * out_rs + (offs % cols) * out_cs, u.to(tl.bfloat16), mask=mask)


@triton.jit
def _apply_kernel(table_ptr, alphas_ptr, blocks_ptr, skip_ptr, decay, SKIPPABLE: tl.constexpr, BLOCK: tl.constexpr):
    matrix, offs = _block(blocks_ptr, BLOCK)
    row = table_ptr + matrix * 6  # param, update pointers; numel, cols, update strides
    param = tl.load(row).to(tl.pointer_type(tl.float32))
    update = tl.load(row + 1).to(tl.pointer_type(tl.bfloat16))
    numel, cols = tl.load(row + 2), tl.load(row + 3)
    up_rs, up_cs = tl.load(row + 4), tl.load(row + 5)
    alpha = tl.load(alphas_ptr + matrix)
    mask = offs < numel
    u = tl.load(update + (offs // cols) * up_rs + (offs % cols) * up_cs, mask=mask).to(tl.float32)
    p = tl.load(param + offs, mask=mask)
    new = p * decay + alpha * u
    if SKIPPABLE:
        new = tl.where(tl.load(skip_ptr) != 0, p, new)
    tl.store(param + offs, new, mask=mask)


@functools.lru_cache(maxsize=16)
def _block_table(numels: tuple[int, ...], block: int, device: torch.device) -> torch.Tensor:
    """(programs, 2) int32: each program's (matrix, block index); the same for every step of a model."""
    pairs = [(i, b) for i, n in enumerate(numels) for b in range(triton.cdiv(n, block))]
    return torch.tensor(pairs, dtype=torch.int32).to(device)


def _to_device(rows: list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    table = torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":  # pinned: the copy is queued without waiting for the GPU
        return table.pin_memory().to(device, non_blocking=True)
    return table


def _check(fp32: list[list[torch.Tensor]], views: list[torch.Tensor]) -> None:
    for group in fp32:
        for t, v in zip(group, views):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.shape != v.shape or t.dim() != 2:
                raise ValueError(f"Muon's kernel takes contiguous fp32 matrices of the update's shape, got {t.shape}")
    if any(v.dtype != torch.bfloat16 for v in views):
        raise ValueError("Muon's kernel takes bf16 updates")


def _scalar(t: torch.Tensor | None, what: str, unused: torch.Tensor) -> torch.Tensor:
    """`t`, checked to be one fp32 value on `unused`'s device, for a kernel to read; `unused` when not given
    (any pointer: the kernel's constexpr switch leaves it unread)."""
    if t is None:
        return unused
    if t.numel() != 1 or t.dtype != torch.float32 or t.device != unused.device:
        raise ValueError(
            f"Muon's kernel takes {what} as one fp32 value on {unused.device}, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}"
        )
    return t


def stage_momentum_(grads, bufs, outs, momentum: float, nesterov: bool, grad_scale=None, skip=None) -> None:
    _check([grads, bufs], outs)
    device = grads[0].device
    rows = [
        [g.data_ptr(), b.data_ptr(), o.data_ptr(), g.numel(), g.size(1), *o.stride()]
        for g, b, o in zip(grads, bufs, outs)
    ]
    blocks = _block_table(tuple(g.numel() for g in grads), BLOCK, device)
    _stage_kernel[(blocks.size(0),)](
        _to_device(rows, torch.int64, device), blocks, _scalar(grad_scale, "the gradient scale", grads[0]),
        _scalar(skip, "the skip flag", grads[0]), 1 - momentum, momentum,
        NESTEROV=nesterov, SCALED=grad_scale is not None, SKIPPABLE=skip is not None, BLOCK=BLOCK, num_warps=WARPS,
    )  # fmt: skip


def apply_updates_(params, updates, decay: float, alphas: list[float], skip=None) -> None:
    _check([params], updates)
    device = params[0].device
    rows = [[p.data_ptr(), u.data_ptr(), p.numel(), p.size(1), *u.stride()] for p, u in zip(params, updates)]
    blocks = _block_table(tuple(p.numel() for p in params), BLOCK, device)
    _apply_kernel[(blocks.size(0),)](
        _to_device(rows, torch.int64, device), _to_device([alphas], torch.float32, device)[0], blocks,
        _scalar(skip, "the skip flag", params[0]), decay, SKIPPABLE=skip is not None, BLOCK=BLOCK, num_warps=WARPS,
    )  # fmt: skip
