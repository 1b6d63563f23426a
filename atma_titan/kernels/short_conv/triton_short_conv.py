"""The Triton kernel of the gated short convolution's backward (reference.py has the math).

`_gated_conv_bwd_kernel`, one program per (channel block, row group): for each tile of rows it reads b, c,
x (in_proj's matmul output; the bias, read once per program, is added here) and do once from memory, the
k - 1 rows before the tile (for p) and after it (for dy) again from cache, and writes db, dc, dx (in_proj's
output gradient), o (out_proj's input, recomputed for its weight gradient), and for its row group the
column sums of [db, dc, dx] (in_proj's bias gradient) and dw (the convolution's weight gradient), summed
by the caller: deterministic, no atomics. A memory-bound pass: 4 reads and 4 writes per channel and token,
where autograd's compiled backward took several passes over z. Rows are tokens of sequences of T: a
row's position in its sequence (row mod T) bounds both shifts, so sequences never mix. With documents
(doc_start), a row's position in its document bounds them instead, so documents never mix either: an int32
a row that the launcher computes once, read for the tile's rows and the k - 1 rows after it (the tap s
steps back of row t counts where s <= t's position in its document). DOCUMENTS is a constexpr: without
documents the kernel compiles as it did before them. No shared memory beyond the reductions, so the one
fixed config fits every GPU (benchmarks/kernels/kernel_resources.py lists it).
Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atma_titan.kernels.documents import check_doc_start, positions_in_document
from atma_titan.kernels.short_conv.ops import MAX_KERNEL

# Tiles of 16 rows x 64 channels, 4 warps, 2,048 rows a program: on the H200 at 16 x 2,048 tokens x 1,024
# channels the fastest of 16 configs in a first sweep (0.29 ms, the launcher's allocations and sums included)
# and within 4% of the fastest in benchmarks/kernels/fused_backward.py's run (0.28 ms; 16 x 128, 8 warps: 0.27).
# A thread holds 8 elements of a tile in each of 6 fp32 accumulators and ~10 live tiles: 222 registers on
# sm_90, no spills; a first version's tiles of 16 elements a thread spilled and took twice as long.
BLOCK_M, BLOCK_N, NUM_WARPS = 16, 64, 4
ROWS_PER_PROGRAM = 2048


@triton.jit
def _gated_conv_bwd_kernel(
    z_ptr, bias_ptr, w_ptr, do_ptr, dz_ptr, o_ptr, part_ptr, w_part_ptr, reach_ptr, M, C, T, rows_per_program,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, DOCUMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    col_block, group = tl.program_id(0), tl.program_id(1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < C
    tile_rows = tl.arange(0, BLOCK_M)
    # Offsets within a tile in int32 from a per-tile int64 base: [b, c, x] rows of 3C, do / o rows of C.
    z_off = tile_rows[:, None] * (3 * C) + cols[None, :]
    off = tile_rows[:, None] * C + cols[None, :]
    # Column sums, reduced over rows once after the loop: [db, dc, dx], and sum_t dy[t] p[t - s] for s < K <= 4
    sum_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sum_c = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sum_x = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dw0 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dw1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dw2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dw3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    bias_b = tl.zeros([1, BLOCK_N], tl.float32)
    bias_c = tl.zeros([1, BLOCK_N], tl.float32)
    bias_x = tl.zeros([1, BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias_b += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        bias_c += tl.load(bias_ptr + C + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        bias_x += tl.load(bias_ptr + 2 * C + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    first = group * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for start in range(first, last, BLOCK_M):
        if DOCUMENTS:  # each row's position in its document (reach_ptr) bounds both shifts
            reach = tl.load(reach_ptr + start + tile_rows, mask=start + tile_rows < last, other=0)
        else:
            pos = (start + tile_rows) % T  # each row's position in its sequence bounds both shifts
        ok = (start + tile_rows < last)[:, None] & col_ok[None, :]
        z_tile = z_ptr + tl.cast(start, tl.int64) * (3 * C)  # b; c and x are C and 2C columns on
        do_tile = do_ptr + tl.cast(start, tl.int64) * C
        # dp[t] = sum_s w[K-1-s] dy[t + s], dy = do * c (zero past the sequence)
        c = tl.load(z_tile + z_off + C, mask=ok, other=0.0).to(tl.float32) + bias_c
        do = tl.load(do_tile + off, mask=ok, other=0.0).to(tl.float32)
        dy = do * c
        dp = tl.load(w_ptr + cols * K + (K - 1), mask=col_ok, other=0.0).to(tl.float32)[None, :] * dy
        for s in tl.static_range(1, K):
            if DOCUMENTS:  # row t + s's tap s reads row t: a row past M or of another sequence reads as 0 < s
                after_rows = start + tile_rows + s
                after = ok & (tl.load(reach_ptr + after_rows, mask=after_rows < M, other=0) >= s)[:, None]
            else:
                after = ok & (pos + s < T)[:, None]
            c_s = tl.load(z_tile + z_off + (s * 3 * C + C), mask=after, other=0.0).to(tl.float32) + bias_c
            do_s = tl.load(do_tile + off + s * C, mask=after, other=0.0).to(tl.float32)
            tap = tl.load(w_ptr + cols * K + (K - 1 - s), mask=col_ok, other=0.0).to(tl.float32)[None, :]
            dp += tap * (do_s * c_s)  # do_s is zero where `after` is false
        b = tl.load(z_tile + z_off, mask=ok, other=0.0).to(tl.float32) + bias_b
        x = tl.load(z_tile + z_off + 2 * C, mask=ok, other=0.0).to(tl.float32) + bias_x
        db = tl.where(ok, dp * x, 0.0)  # zero outside the tile, so nothing there reaches the sums
        dx = tl.where(ok, dp * b, 0.0)
        tl.store(dz_ptr + tl.cast(start, tl.int64) * (3 * C) + z_off, db.to(dz_ptr.dtype.element_ty), mask=ok)
        tl.store(dz_ptr + tl.cast(start, tl.int64) * (3 * C) + z_off + 2 * C, dx.to(dz_ptr.dtype.element_ty), mask=ok)
        sum_b += db
        sum_x += dx
        # y[t] = sum_s w[K-1-s] p[t - s], p = b * x (zero before the sequence); dw[K-1-s] += sum_t dy[t] p[t - s]
        p = b * x
        y = tl.load(w_ptr + cols * K + (K - 1), mask=col_ok, other=0.0).to(tl.float32)[None, :] * p
        dw0 += dy * p
        for s in tl.static_range(1, K):
            if DOCUMENTS:
                before = ok & (reach >= s)[:, None]
            else:
                before = ok & (pos >= s)[:, None]
            b_s = tl.load(z_tile + z_off - s * 3 * C, mask=before, other=0.0).to(tl.float32) + bias_b
            x_s = tl.load(z_tile + z_off + (2 * C - s * 3 * C), mask=before, other=0.0).to(tl.float32) + bias_x
            p_s = tl.where(before, b_s * x_s, 0.0)
            tap = tl.load(w_ptr + cols * K + (K - 1 - s), mask=col_ok, other=0.0).to(tl.float32)[None, :]
            y += tap * p_s
            if s == 1:
                dw1 += dy * p_s
            elif s == 2:
                dw2 += dy * p_s
            else:
                dw3 += dy * p_s
        dc = tl.where(ok, do * y, 0.0)
        tl.store(dz_ptr + tl.cast(start, tl.int64) * (3 * C) + z_off + C, dc.to(dz_ptr.dtype.element_ty), mask=ok)
        tl.store(o_ptr + tl.cast(start, tl.int64) * C + off, (c * y).to(o_ptr.dtype.element_ty), mask=ok)
        sum_c += dc
    part = part_ptr + group.to(tl.int64) * (3 * C) + cols
    tl.store(part, tl.sum(sum_b, axis=0), mask=col_ok)
    tl.store(part + C, tl.sum(sum_c, axis=0), mask=col_ok)
    tl.store(part + 2 * C, tl.sum(sum_x, axis=0), mask=col_ok)
    w_part = w_part_ptr + group.to(tl.int64) * (C * K) + cols * K + (K - 1)  # tap K-1-s pairs with shift s
    tl.store(w_part, tl.sum(dw0, axis=0), mask=col_ok)
    if K > 1:
        tl.store(w_part - 1, tl.sum(dw1, axis=0), mask=col_ok)
    if K > 2:
        tl.store(w_part - 2, tl.sum(dw2, axis=0), mask=col_ok)
    if K > 3:
        tl.store(w_part - 3, tl.sum(dw3, axis=0), mask=col_ok)


def _check(
    u: torch.Tensor,
    do: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    doc_start: torch.Tensor | None = None,
) -> None:
    if u.ndim != 3 or u.shape[2] % 3 or not u.is_contiguous():
        raise ValueError(f"u must be a contiguous (batch, time, 3 x channels) tensor, got {tuple(u.shape)}")
    channels = u.shape[2] // 3
    if do.shape != (*u.shape[:2], channels) or not do.is_contiguous():
        raise ValueError(f"do {tuple(do.shape)} must be a contiguous {(*u.shape[:2], channels)} tensor")
    if do.dtype != u.dtype:
        raise ValueError(f"u ({u.dtype}) and do ({do.dtype}) must share a dtype")
    kernel_ok = weight.ndim == 2 and weight.shape[0] == channels and 1 <= weight.shape[1] <= MAX_KERNEL
    if not kernel_ok or not weight.is_contiguous():
        raise ValueError(
            f"weight {tuple(weight.shape)} must be a contiguous ({channels}, kernel <= {MAX_KERNEL}) matrix"
        )
    if bias is not None and (bias.shape != u.shape[2:] or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} must be a contiguous ({u.shape[2]},) vector")
    check_doc_start(doc_start, u.shape[0], u.shape[1])


def gated_conv_backward(
    u: torch.Tensor,
    do: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    doc_start: torch.Tensor | None = None,
    rows_per_program: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dz, o, column sums of dz in fp32, dw in fp32) for z = u + bias, u (B, T, 3C), bias (3C,) or None,
    do (B, T, C), the conv weight (C, k) and doc_start (B, T) or None (reference.py)."""
    _check(u, do, weight, bias, doc_start)
    batch, seq_len, channels = do.shape
    kernel = weight.shape[1]
    m = batch * seq_len
    rows_per_program = triton.cdiv(rows_per_program or ROWS_PER_PROGRAM, BLOCK_M) * BLOCK_M  # whole tiles
    groups = max(triton.cdiv(m, rows_per_program), 1)
    dz, o = torch.empty_like(u), torch.empty_like(do)
    parts = torch.empty((groups, 3 * channels), dtype=torch.float32, device=u.device)
    w_parts = torch.empty((groups, channels, kernel), dtype=torch.float32, device=u.device)
    if m == 0:
        return dz, o, parts.new_zeros(3 * channels), w_parts.new_zeros(channels, kernel)
    # each row's position in its document, flattened as the rows are: one int32 a token, read k times a tile
    reach = u if doc_start is None else positions_in_document(doc_start).to(torch.int32).reshape(m)
    _gated_conv_bwd_kernel[(triton.cdiv(channels, BLOCK_N), groups)](
        u, u if bias is None else bias, weight, do, dz, o, parts, w_parts, reach, m, channels, seq_len,
        rows_per_program, K=kernel, HAS_BIAS=bias is not None, DOCUMENTS=doc_start is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
    )  # fmt: skip
    return dz, o, parts.sum(0), w_parts.sum(0)
