"""Triton kernels for the chunked gated delta rule: training forward and backward.

Same recurrence, layout and chunked (WY / UT) derivation as reference.py. Per (batch, head) the
sequence is cut into chunks of C = 64 tokens; a tail chunk is padded with identity steps
(q = k = v = 0, beta = 0, log_gamma = 0), which change neither the outputs nor the state.

Forward, three kernels:
  _prepare_kernel   chunk-parallel: g = cumsum(log_gamma), T = (I + A)^{-1} in fp32 (16 x 16 diagonal
                    blocks by forward substitution, then two exact doublings with fp32-accurate
                    products; T is stored only for the backward), W = T diag(beta G) K, U~ = T diag(beta) V
  _state_fwd_kernel sequential over chunks per (batch, head, Dv block): carries the fp32 state S,
                    stores each chunk's start state and U = U~ - W S^T, returns the final state
  _output_kernel    chunk-parallel: R = diag(G) Q S^T + (Q K^T * D) U

Backward (from the inputs and the training forward's workspaces, WORKSPACES, which it keeps rather
than have the backward run _prepare_kernel and _state_fwd_kernel again):
  _dv_local_kernel  chunk-parallel: dU_local = (Q K^T * D)^T dR
  _state_bwd_kernel reverse over chunks: dS_end (gradient of each chunk's end state),
                    dU = dU_local + Kd dS_end^T, and dS_start = G_C dS_end + dR^T G Q - dU^T W
  _grad_transform_kernel  chunk-parallel: dv, dbeta, and the parts of dk and dg through the UT
                    transform (X = T B  =>  dB = T^T dX, dA = -dB X^T on the strict lower triangle),
                    into fp32 workspaces dk_partial and dg_partial
  _grad_output_kernel     chunk-parallel: dq, the rest of dk and dg (through the output and the state
                    recurrence), the reverse cumsum of dg into dlog_gamma and the L2 normalisation.
                    Two kernels, not one: one held the accumulators of both and spilled.

Documents (doc_start, kernels/documents.py): the state is zeroed before each document start, exactly,
wherever it falls in a chunk. Every kernel masks what carries the state across a reset, as reference.py's
chunked form does: the decay matrix D and A within one segment, G_t to segment 0, exp(g_C - g_t) to the
last segment, G_C to chunks without a reset; the prepare kernel leaves the resets' log_gamma out of g and
_grad_output_kernel zeroes their gradient. The chunk-parallel kernels read the segments of their chunk off
doc_start (_chunk_documents: rows of one document). The sequential kernels, whose per-chunk latency is the
recurrence's, read two scalars a chunk instead, its first and last reset rows (reset_rows, _new_reset_rows),
which the first chunk-parallel kernel of each direction (_prepare_kernel, _dv_local_kernel) writes.
HAS_DOCS (constexpr) = False compiles the kernels of before.

Only the Triton kernels and their launchers live here; torch.library registration and the
`gated_delta(..., impl=)` entry point are in ops.py, the decode step in triton_step.py. Importing this
module imports triton: on CPU that only works with TRITON_INTERPRET=1 set beforehand
(`backends.INTERPRET`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atma_titan.kernels import resources
from atma_titan.kernels.backends import AUTOTUNE, INTERPRET

CHUNK = 64
L2_EPS = tl.constexpr(1e-6)  # F.normalize's eps, as in reference.L2_NORM_EPS
# (I + A)^{-1}: diagonal blocks of INVERSE_BLOCK by forward substitution, then INVERSE_LEVELS doublings to CHUNK
INVERSE_BLOCK = tl.constexpr(16)
INVERSE_LEVELS = tl.constexpr(2)


# Smallest side of a tile that reaches a tl.dot on the GPU (BK, BVF and every BV are at least this).
# Triton >= 3.6 miscompiles Hopper (sm_90) wgmma kernels that hold several tl.dot when a dot side is
# 16 or 32: illegal shared-memory addresses or silently wrong tiles (triton-lang/triton#10486,
# #10573, #11366). On the H200 this crashed the first autotuning of a BV = 32 config with Dk = 64
# ("illegal memory access", sticky for the rest of the process). Every dot here has one side
# C = 64, so with BK, BV >= 64 no dot side is below 64; a smaller Dk or Dv is zero-padded by masks.
# The interpreter keeps 16 so the small CPU tests still cover several Dv blocks.
MIN_DOT_BLOCK = 16 if INTERPRET else 64

# Dv blocks (BV) of the autotuned kernels. GPU lists are all >= MIN_DOT_BLOCK on the GPU (checked by
# tests/kernels/interpreter/gated_delta_triton_cases.py, which also runs the kernels under the interpreter with them).
GPU_BLOCK_VALUES = {"sequential": [64], "parallel": [64, 128], "grad": [64]}
INTERPRETER_BLOCK_VALUES = {"sequential": [16, 32, 64], "parallel": [16, 64], "grad": [16, 32]}


def _block(dim: int) -> int:
    """Tile side for a feature dim: a power of two, at least MIN_DOT_BLOCK (read at launch time)."""
    return max(MIN_DOT_BLOCK, triton.next_power_of_2(dim))


def _prune_wide_blocks(configs, named_args, **kwargs):
    """Drop configs whose BV exceeds the padded Dv (they only add masked-off work); keep at least one."""
    value_dim = kwargs.get("DV", named_args.get("DV"))
    if value_dim is None:
        return configs
    kept = [c for c in configs if c.kwargs["BV"] <= _block(value_dim)]
    return kept or [min(configs, key=lambda c: c.kwargs["BV"])]


def _tune(configs: list[triton.Config], key: list[str]):
    """Autotune on a GPU over the configs whose BV suits Dv and whose compiled shared memory fits the device
    (resources.autotune); without backends.AUTOTUNE (ATMA_TRITON_AUTOTUNE=0) the first of those runs,
    untuned. Under the interpreter (where several configs crash) only the first config is kept."""
    return resources.autotune(
        configs[:1] if INTERPRET else configs, key, single=not AUTOTUNE, pre_prune=_prune_wide_blocks
    )


def _configs(block_values: list[int], warps: list[int], stages: list[int]) -> list[triton.Config]:
    return [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in block_values for w in warps for s in stages]


# Under the interpreter the first config is used: BV = 16 so tests with Dv = 32 cover several Dv blocks.
_BV = INTERPRETER_BLOCK_VALUES if INTERPRET else GPU_BLOCK_VALUES
SEQUENTIAL_CONFIGS = _configs(_BV["sequential"], [4, 8], [2, 3])
PARALLEL_CONFIGS = _configs(_BV["parallel"], [4, 8], [2, 3])
# One warpgroup: the prepare kernel's (C, C) tiles come out of wgmma, which has 4 warps cover 64 rows;
# 8 warps duplicate them, and in this kernel spill (benchmarks/kernels/gated_delta.py --resources).
PREPARE_WARPS = 4
# 8 warps, 2 stages first: the choice without autotuning (ATMA_TRITON_AUTOTUNE=0), whose two gradient
# kernels spill least on sm_80 / 89 / 90 of these four (benchmarks/results/kernel_resources-sm80_89_90-2026-12-07.json).
GRAD_CONFIGS = _configs(_BV["grad"], [8, 4], [2] if INTERPRET else [2, 1])


# ---------------------------------------------------------------------------------------------
# Small helpers shared by the kernels


@triton.jit
def _normalize_rows(x, NORMALIZE: tl.constexpr):
    """(x / max(||x||, eps), ||x||, max(||x||, eps)) row-wise, F.normalize's semantics.

    The norms are fp32; the normalised rows stay in x's dtype (a bf16 tile holds half the registers
    of an fp32 one, and the tensor-core products take bf16 operands anyway)."""
    wide = x.to(tl.float32)
    norm = tl.sqrt(tl.sum(wide * wide, axis=1))
    denom = tl.maximum(norm, L2_EPS)
    if NORMALIZE:
        x = (wide / denom[:, None]).to(x.dtype)
    return x, norm, denom


@triton.jit
def _normalize_rows_backward(x_hat, norm, denom, dx_hat, NORMALIZE: tl.constexpr):
    """Jacobian of x / max(||x||, eps): (dx^ - x^ (x^ . dx^)) / ||x||, or dx^ / eps below eps."""
    if NORMALIZE:
        along = tl.where(norm > L2_EPS, tl.sum(x_hat * dx_hat, axis=1), 0.0)
        dx_hat = (dx_hat - along[:, None] * x_hat) / denom[:, None]
    return dx_hat


@triton.jit
def _load_tokens(ptr, b, h, t, t_mask, cols, T, H: tl.constexpr, D: tl.constexpr):
    """Rows t of a (B, T, H, D) tensor at (b, h) in its own dtype, zero outside the sequence / feature dim."""
    base = ptr + (b.to(tl.int64) * T * H + h) * D  # scalar 64-bit base, 32-bit offsets within a sequence
    mask = t_mask[:, None] & (cols < D)[None, :]
    return tl.load(base + t[:, None] * (H * D) + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _store_tokens(ptr, x, b, h, t, t_mask, cols, T, H: tl.constexpr, D: tl.constexpr):
    base = ptr + (b.to(tl.int64) * T * H + h) * D
    mask = t_mask[:, None] & (cols < D)[None, :]
    tl.store(base + t[:, None] * (H * D) + cols[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_offsets(b, h, t, T, H: tl.constexpr):
    return ((b * T + t) * H + h).to(tl.int64)


@triton.jit
def _workspace_ptrs(ptr, bh, t, cols, padded_len, D: tl.constexpr):
    """Rows t of a head-major (B * H, padded_len, D) workspace at bh: a scalar 64-bit base and 32-bit
    offsets within one (batch, head) (a tile of int64 offsets costs twice the registers)."""
    return ptr + bh.to(tl.int64) * padded_len * D + (t[:, None] * D + cols[None, :])


@triton.jit
def _state_ptrs(ptr, index, v_cols, k_cols, DV: tl.constexpr, DK: tl.constexpr):
    """The (DV, DK) matrix number `index` (scalar 64-bit base, 32-bit offsets) and its in-bounds mask."""
    ptrs = ptr + index.to(tl.int64) * DV * DK + (v_cols[:, None] * DK + k_cols[None, :])
    return ptrs, (v_cols < DV)[:, None] & (k_cols < DK)[None, :]


@triton.jit
def _head_layout(bh, T, H: tl.constexpr, C: tl.constexpr):
    """(b, h, n_chunks, padded_len, rows) of the (batch, head) program index bh: its batch and head, the
    chunk count, the padded length of the head-major workspaces and the row indices of one chunk."""
    b, h = bh // H, bh % H
    n_chunks = tl.cdiv(T, C)
    padded_len = n_chunks * C
    rows = tl.arange(0, C)
    return b, h, n_chunks, padded_len, rows


@triton.jit
def _chunk_tokens(n, rows, T, C: tl.constexpr):
    """Token indices t of chunk n and the mask of those inside the sequence (t < T)."""
    t = n * C + rows
    return t, t < T


@triton.jit
def _decay_ptrs(g_ptr, bh, t, padded_len):
    """Rows t of the cumulative log decays g, a head-major (B * H, padded_len) fp32 workspace, at bh."""
    return g_ptr + bh.to(tl.int64) * padded_len + t


@triton.jit
def _chunk_end_decay(g_ptr, bh, n, padded_len, C: tl.constexpr):
    """g at the last row of chunk n: the chunk's total log decay."""
    return tl.load(_decay_ptrs(g_ptr, bh, n * C, padded_len) + C - 1)


@triton.jit
def _inverse_ptrs(ptr, bh, n, n_chunks, rows, C: tl.constexpr):
    """The (C, C) tile T = (I + A)^{-1} of chunk n at bh in its (B * H, n_chunks, C, C) workspace."""
    return ptr + ((bh * n_chunks + n).to(tl.int64) * C * C + rows[:, None] * C + rows[None, :])


@triton.jit
def _chunk_documents(doc_start_ptr, b, n, t, t_mask, T, C: tl.constexpr, HAS_DOCS: tl.constexpr):
    """The segments of chunk n (rows of one document, see reference.py), read off doc_start (B, T) int32
    without a scan, for its rows t: (first, continues, in_last, no_reset, resets).

    first: the row where t's segment begins (0 for the chunk's first segment), so seg_s == seg_t for s <= t
    exactly when s >= first_t; continues: t's segment is segment 0, the one that reads the chunk's start
    state (its document began before the chunk, or is the window's first); in_last: t's segment is the
    chunk's last; no_reset: the chunk holds no reset (one segment); resets: a document begins at t > 0.
    Without documents nothing is loaded or computed: the callers read none of it (the constants below
    are dropped by the compiler)."""
    if HAS_DOCS:
        row_starts = doc_start_ptr + b.to(tl.int64) * T
        starts = tl.load(row_starts + t, mask=t_mask, other=-1)
        chunk_start = n * C
        first = tl.maximum(starts - chunk_start, 0)
        continues = (starts < chunk_start) | (starts == 0)
        last_start = tl.load(row_starts + tl.minimum(chunk_start + C, T) - 1)  # the chunk's last token's document
        in_last = starts == last_start
        no_reset = (last_start < chunk_start) | (last_start == 0)
        resets = (starts == t) & (t > 0)
    else:
        first = t * 0
        continues = t >= 0
        in_last = continues
        no_reset = True
        resets = t < 0
    return first, continues, in_last, no_reset, resets


@triton.jit
def _store_reset_rows(reset_rows_ptr, resets, rows, b, n, n_chunks, owner, C: tl.constexpr):
    """Chunk n's first and last reset rows (C and -1 where it holds none), from _chunk_documents' resets, into
    the (B, n_chunks, 2) int32 reset_rows; one program of the chunk (owner) writes them."""
    first = tl.min(tl.where(resets, rows, C), axis=0)
    last = tl.max(tl.where(resets, rows, -1), axis=0)
    chunk = reset_rows_ptr + (b * n_chunks + n) * 2
    tl.store(chunk, first, mask=owner)
    tl.store(chunk + 1, last, mask=owner)


@triton.jit
def _chunk_resets(reset_rows_ptr, b, n, n_chunks, rows, HAS_DOCS: tl.constexpr):
    """(continues, in_last, no_reset) of _chunk_documents for chunk n, from the two scalars _store_reset_rows
    wrote: what the sequential kernels need, without reading doc_start. (They differ from _chunk_documents'
    only on the padding rows past T, whose q and k are zero.)"""
    if HAS_DOCS:
        chunk = reset_rows_ptr + (b * n_chunks + n) * 2
        first = tl.load(chunk)
        last = tl.load(chunk + 1)
        continues = rows < first
        in_last = rows >= last
        no_reset = last < 0
    else:
        continues = rows >= 0
        in_last = continues
        no_reset = True
    return continues, in_last, no_reset


@triton.jit
def _decay_matrix(g, rows, first, STRICT: tl.constexpr, HAS_DOCS: tl.constexpr):
    """exp(g_t - g_s) for s < t (STRICT) or s <= t, within t's segment (s >= first_t, HAS_DOCS), else 0;
    masked in log space so nothing overflows."""
    if STRICT:
        keep = rows[:, None] > rows[None, :]
    else:
        keep = rows[:, None] >= rows[None, :]
    if HAS_DOCS:
        keep = keep & (rows[None, :] >= first[:, None])
    return tl.exp(tl.where(keep, g[:, None] - g[None, :], float("-inf")))


@triton.jit
def _from_start(g, continues, HAS_DOCS: tl.constexpr):
    """G_t = exp(g_t): how much of the chunk's start state row t reads; 0 after a reset in the chunk."""
    decay = tl.exp(g)
    if HAS_DOCS:
        decay = tl.where(continues, decay, 0.0)
    return decay


@triton.jit
def _to_end(g, g_end, in_last, no_reset, HAS_DOCS: tl.constexpr):
    """(exp(g_C - g_t), G_C = exp(g_C)): how row t's write and the chunk's start state reach its end state;
    0 for a write before the chunk's last reset, and for the start state of a chunk that holds a reset."""
    to_end = tl.exp(g_end - g)
    chunk_decay = tl.exp(g_end)
    if HAS_DOCS:
        to_end = tl.where(in_last, to_end, 0.0)
        chunk_decay = tl.where(no_reset, chunk_decay, 0.0)
    return to_end, chunk_decay


@triton.jit
def _unit_lower_inverse(a_t, rows, C: tl.constexpr, PREC: tl.constexpr):
    """(I + a)^{-1} for a strictly lower triangular a, given as a_t = a^T, in fp32, blocked.

    1. The B x B diagonal blocks, all C / B of them at once, by forward substitution (B - 1 steps
       instead of C - 1): step s finishes row s of every block, e_i - sum_{j<i} a_ij (row j), the
       rows j < i of its block being final. Within the block diagonal the C / B rows of step s touch
       disjoint columns, so their a_ij gather into one vector and their updates into one reduction.
    2. Doubling, B -> 2B -> ... -> C: with X the inverse of the block diagonal of I + a in blocks of L,
       and E the part of a in the lower-left L x L block of every 2L x 2L diagonal block,
       X - X E X = [[X1, 0], [-X2 E X1, X2]] inverts the 2L block diagonal exactly. X E X lands where X
       is zero, so nothing cancels (unlike a Neumann series / product form, which subtracts large terms).
       The products are C x C x C dots (no side below C = 64, see MIN_DOT_BLOCK) with fp32 accuracy:
       PREC is "tf32x3" for half inputs and "ieee" for fp32 ones."""
    B: tl.constexpr = INVERSE_BLOCK
    tl.static_assert(C == B << INVERSE_LEVELS)
    block = rows // B
    same_block = block[:, None] == block[None, :]
    in_block = rows % B
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for s in range(1, B):
        # a[i, j] for i = row s of j's block (zero for j >= i: a is strictly lower), indexed by j
        a_rows = tl.sum(tl.where(same_block & (in_block[None, :] == s), a_t, 0.0), axis=1)
        update = tl.sum(a_rows[:, None] * inverse, axis=0)  # column c: row s of c's block
        inverse = tl.where(same_block & (in_block[:, None] == s), inverse - update[None, :], inverse)
    for level in tl.static_range(INVERSE_LEVELS):
        size = B << level
        pair = rows // size
        upper_right = (pair[None, :] == pair[:, None] + 1) & (pair[None, :] % 2 == 1)
        e_t = tl.where(upper_right, a_t, 0.0)  # E^T, so that only a_t stays live
        x_e = tl.dot(inverse, tl.trans(e_t), input_precision=PREC)
        inverse = inverse - tl.dot(x_e, inverse, input_precision=PREC)
    return inverse


# ---------------------------------------------------------------------------------------------
# Forward kernels


@triton.jit
def _prepare_kernel(
    k_ptr,
    v_ptr,
    log_gamma_ptr,
    beta_ptr,
    g_ptr,
    inverse_ptr,
    w_ptr,
    u_tilde_ptr,
    T,
    doc_start_ptr,
    reset_rows_ptr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BVF: tl.constexpr,
    C: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PREC: tl.constexpr,
    INV_PREC: tl.constexpr,
    STORE_INVERSE: tl.constexpr,
):
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h, n_chunks, padded_len, rows = _head_layout(bh, T, H, C)
    t, t_mask = _chunk_tokens(n, rows, T, C)
    k_cols, v_cols = tl.arange(0, BK), tl.arange(0, BVF)
    DT = w_ptr.dtype.element_ty

    gates = _gate_offsets(b, h, t, T, H)
    log_gamma = tl.load(log_gamma_ptr + gates, mask=t_mask, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + gates, mask=t_mask, other=0.0).to(tl.float32)
    first, continues, _, _, resets = _chunk_documents(doc_start_ptr, b, n, t, t_mask, T, C, HAS_DOCS)
    if HAS_DOCS:  # a reset's gamma multiplies a zeroed state: dropped from g, its gradient is exactly 0
        log_gamma = tl.where(resets, 0.0, log_gamma)
        _store_reset_rows(reset_rows_ptr, resets, rows, b, n, n_chunks, h == 0, C)  # for _state_fwd_kernel
    g = tl.cumsum(log_gamma, axis=0)
    tl.store(_decay_ptrs(g_ptr, bh, t, padded_len), g)

    k, _, _ = _normalize_rows(_load_tokens(k_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
    k_dt = k.to(DT)
    key_overlap = tl.dot(k_dt, tl.trans(k_dt), input_precision=PREC)
    # A^T, built directly (key_overlap is symmetric): A[i, j] = beta_i k_i.k_j exp(g_i - g_j) for j < i
    # (and j in i's segment)
    later = rows[:, None] < rows[None, :]
    if HAS_DOCS:
        later = later & (rows[:, None] >= first[None, :])
    decay_t = tl.exp(tl.where(later, g[None, :] - g[:, None], float("-inf")))
    inverse_dt = _unit_lower_inverse(key_overlap * beta[None, :] * decay_t, rows, C, INV_PREC).to(DT)
    if STORE_INVERSE:  # only the backward reads it (in the dtype of the products it feeds)
        tl.store(_inverse_ptrs(inverse_ptr, bh, n, n_chunks, rows, C), inverse_dt)

    # k again (an L2 hit) rather than holding it in registers across the inverse
    k, _, _ = _normalize_rows(_load_tokens(k_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
    w = tl.dot(inverse_dt, (k * (beta * _from_start(g, continues, HAS_DOCS))[:, None]).to(DT), input_precision=PREC)
    tl.store(_workspace_ptrs(w_ptr, bh, t, k_cols, padded_len, DK), w.to(DT), mask=(k_cols < DK)[None, :])
    v = _load_tokens(v_ptr, b, h, t, t_mask, v_cols, T, H, DV)
    u_tilde = tl.dot(inverse_dt, (v * beta[:, None]).to(DT), input_precision=PREC)
    tl.store(_workspace_ptrs(u_tilde_ptr, bh, t, v_cols, padded_len, DV), u_tilde.to(DT), mask=(v_cols < DV)[None, :])


@_tune(SEQUENTIAL_CONFIGS, key=["DK", "DV", "NORMALIZE", "HAS_DOCS"])
@triton.jit
def _state_fwd_kernel(
    k_ptr,
    g_ptr,
    w_ptr,
    u_tilde_ptr,
    u_ptr,
    states_ptr,
    initial_ptr,
    final_ptr,
    T,
    reset_rows_ptr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    C: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    PREC: tl.constexpr,
    BV: tl.constexpr,
):
    vb, bh = tl.program_id(0), tl.program_id(1)
    b, h, n_chunks, padded_len, rows = _head_layout(bh, T, H, C)
    k_cols, v_cols = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    v_in = (v_cols < DV)[None, :]
    DT = w_ptr.dtype.element_ty

    initial, state_mask = _state_ptrs(initial_ptr, bh, v_cols, k_cols, DV, DK)
    if HAS_INITIAL:
        state = tl.load(initial, mask=state_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BV, BK], dtype=tl.float32)

    for n in range(n_chunks):
        chunk_state, _ = _state_ptrs(states_ptr, bh * n_chunks + n, v_cols, k_cols, DV, DK)
        tl.store(chunk_state, state.to(DT), mask=state_mask)
        t, t_mask = _chunk_tokens(n, rows, T, C)
        k, _, _ = _normalize_rows(_load_tokens(k_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
        g = tl.load(_decay_ptrs(g_ptr, bh, t, padded_len))
        g_end = _chunk_end_decay(g_ptr, bh, n, padded_len, C)
        w = tl.load(_workspace_ptrs(w_ptr, bh, t, k_cols, padded_len, DK), mask=(k_cols < DK)[None, :], other=0.0)
        u_tilde = tl.load(_workspace_ptrs(u_tilde_ptr, bh, t, v_cols, padded_len, DV), mask=v_in, other=0.0)
        u_tilde = u_tilde.to(tl.float32)

        u = (u_tilde - tl.dot(w, tl.trans(state.to(DT)), input_precision=PREC)).to(DT)  # the deltas, (C, BV)
        tl.store(_workspace_ptrs(u_ptr, bh, t, v_cols, padded_len, DV), u, mask=v_in)
        _, in_last, no_reset = _chunk_resets(reset_rows_ptr, b, n, n_chunks, rows, HAS_DOCS)
        to_end, chunk_decay = _to_end(g, g_end, in_last, no_reset, HAS_DOCS)
        k_to_end = (k * to_end[:, None]).to(DT)
        state = state * chunk_decay + tl.dot(tl.trans(u), k_to_end, input_precision=PREC)

    tl.store(_state_ptrs(final_ptr, bh, v_cols, k_cols, DV, DK)[0], state, mask=state_mask)


@_tune(PARALLEL_CONFIGS, key=["DK", "DV", "NORMALIZE", "HAS_DOCS"])
@triton.jit
def _output_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    u_ptr,
    states_ptr,
    r_ptr,
    T,
    doc_start_ptr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    C: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PREC: tl.constexpr,
    BV: tl.constexpr,
):
    n, bh, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h, n_chunks, padded_len, rows = _head_layout(bh, T, H, C)
    t, t_mask = _chunk_tokens(n, rows, T, C)
    k_cols, v_cols = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    DT = u_ptr.dtype.element_ty

    q, _, _ = _normalize_rows(_load_tokens(q_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
    k, _, _ = _normalize_rows(_load_tokens(k_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
    q, k = q.to(DT), k.to(DT)
    g = tl.load(_decay_ptrs(g_ptr, bh, t, padded_len))
    chunk_state, state_mask = _state_ptrs(states_ptr, bh * n_chunks + n, v_cols, k_cols, DV, DK)
    state = tl.load(chunk_state, mask=state_mask, other=0.0)
    u = tl.load(_workspace_ptrs(u_ptr, bh, t, v_cols, padded_len, DV), mask=(v_cols < DV)[None, :], other=0.0)

    first, continues, _, _, _ = _chunk_documents(doc_start_ptr, b, n, t, t_mask, T, C, HAS_DOCS)
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * _decay_matrix(g, rows, first, False, HAS_DOCS)
    from_state = tl.dot(q, tl.trans(state), input_precision=PREC)
    r = _from_start(g, continues, HAS_DOCS)[:, None] * from_state + tl.dot(scores.to(DT), u, input_precision=PREC)
    _store_tokens(r_ptr, r, b, h, t, t_mask, v_cols, T, H, DV)


# ---------------------------------------------------------------------------------------------
# Backward kernels


@_tune(PARALLEL_CONFIGS, key=["DK", "DV", "NORMALIZE", "HAS_DOCS"])
@triton.jit
def _dv_local_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    dr_ptr,
    du_local_ptr,
    T,
    doc_start_ptr,
    reset_rows_ptr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    C: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PREC: tl.constexpr,
    BV: tl.constexpr,
):
    """dU_local = (Q K^T * D)^T dR: the intra-chunk part of the deltas' gradient."""
    n, bh, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h, n_chunks, padded_len, rows = _head_layout(bh, T, H, C)
    t, t_mask = _chunk_tokens(n, rows, T, C)
    k_cols, v_cols = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    DT = q_ptr.dtype.element_ty

    q, _, _ = _normalize_rows(_load_tokens(q_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
    k, _, _ = _normalize_rows(_load_tokens(k_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
    g = tl.load(_decay_ptrs(g_ptr, bh, t, padded_len))
    first, _, _, _, resets = _chunk_documents(doc_start_ptr, b, n, t, t_mask, T, C, HAS_DOCS)
    if HAS_DOCS:  # for _state_bwd_kernel
        _store_reset_rows(reset_rows_ptr, resets, rows, b, n, n_chunks, (h == 0) & (vb == 0), C)
    scores = tl.dot(q.to(DT), tl.trans(k.to(DT)), input_precision=PREC) * _decay_matrix(g, rows, first, False, HAS_DOCS)
    dr = _load_tokens(dr_ptr, b, h, t, t_mask, v_cols, T, H, DV).to(DT)
    du_local = tl.dot(tl.trans(scores.to(DT)), dr, input_precision=PREC)
    tl.store(_workspace_ptrs(du_local_ptr, bh, t, v_cols, padded_len, DV), du_local, mask=(v_cols < DV)[None, :])


@_tune(SEQUENTIAL_CONFIGS, key=["DK", "DV", "NORMALIZE", "HAS_DOCS"])
@triton.jit
def _state_bwd_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    w_ptr,
    dr_ptr,
    du_local_ptr,
    du_ptr,
    dstates_ptr,
    dfinal_ptr,
    dinitial_ptr,
    T,
    reset_rows_ptr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    C: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PREC: tl.constexpr,
    BV: tl.constexpr,
):
    vb, bh = tl.program_id(0), tl.program_id(1)
    b, h, n_chunks, padded_len, rows = _head_layout(bh, T, H, C)
    k_cols, v_cols = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    v_in = (v_cols < DV)[None, :]
    DT = w_ptr.dtype.element_ty

    dfinal, state_mask = _state_ptrs(dfinal_ptr, bh, v_cols, k_cols, DV, DK)
    dstate = tl.load(dfinal, mask=state_mask, other=0.0).to(tl.float32)  # d(end state of chunk n)

    for i in range(n_chunks):
        n = n_chunks - 1 - i
        chunk_state, _ = _state_ptrs(dstates_ptr, bh * n_chunks + n, v_cols, k_cols, DV, DK)
        tl.store(chunk_state, dstate.to(DT), mask=state_mask)
        t, t_mask = _chunk_tokens(n, rows, T, C)
        q, _, _ = _normalize_rows(_load_tokens(q_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
        k, _, _ = _normalize_rows(_load_tokens(k_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
        g = tl.load(_decay_ptrs(g_ptr, bh, t, padded_len))
        g_end = _chunk_end_decay(g_ptr, bh, n, padded_len, C)
        w = tl.load(_workspace_ptrs(w_ptr, bh, t, k_cols, padded_len, DK), mask=(k_cols < DK)[None, :], other=0.0)
        dr = _load_tokens(dr_ptr, b, h, t, t_mask, v_cols, T, H, DV).to(DT)
        du_local = tl.load(_workspace_ptrs(du_local_ptr, bh, t, v_cols, padded_len, DV), mask=v_in, other=0.0)

        continues, in_last, no_reset = _chunk_resets(reset_rows_ptr, b, n, n_chunks, rows, HAS_DOCS)
        to_end, chunk_decay = _to_end(g, g_end, in_last, no_reset, HAS_DOCS)
        k_to_end = (k * to_end[:, None]).to(DT)
        du = du_local + tl.dot(k_to_end, tl.trans(dstate.to(DT)), input_precision=PREC)  # (C, BV)
        tl.store(_workspace_ptrs(du_ptr, bh, t, v_cols, padded_len, DV), du, mask=v_in)
        q_from_start = (q * _from_start(g, continues, HAS_DOCS)[:, None]).to(DT)
        dstate = (
            dstate * chunk_decay
            + tl.dot(tl.trans(dr), q_from_start, input_precision=PREC)
            - tl.dot(tl.trans(du.to(DT)), w, input_precision=PREC)
        )

    tl.store(_state_ptrs(dinitial_ptr, bh, v_cols, k_cols, DV, DK)[0], dstate, mask=state_mask)


@_tune(GRAD_CONFIGS, key=["DK", "DV", "NORMALIZE", "HAS_DOCS"])
@triton.jit
def _grad_transform_kernel(
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    inverse_ptr,
    w_ptr,
    u_tilde_ptr,
    du_ptr,
    states_ptr,
    dk_partial_ptr,
    dg_partial_ptr,
    dv_ptr,
    dbeta_ptr,
    T,
    doc_start_ptr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    C: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PREC: tl.constexpr,
    BV: tl.constexpr,
):
    """Gradients through the UT transform: dv, dbeta, and the parts of dk and dg through W and A (into
    dk_partial and dg_partial, fp32, which _grad_output_kernel finishes).

    U~ = T diag(beta) V and W = T diag(beta G) K, so dB = T^T dX for X = U~, W, and
    dA = -(dB_V U~^T + dB_K W^T) = -T^T (dU~ U~^T + dW W^T) on the strict lower triangle.
    U = U~ - W S^T gives dU~ = dU and dW = -dU S."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h, n_chunks, padded_len, rows = _head_layout(bh, T, H, C)
    t, t_mask = _chunk_tokens(n, rows, T, C)
    k_cols = tl.arange(0, BK)
    DT = w_ptr.dtype.element_ty

    gates = _gate_offsets(b, h, t, T, H)
    beta = tl.load(beta_ptr + gates, mask=t_mask, other=0.0).to(tl.float32)
    g = tl.load(_decay_ptrs(g_ptr, bh, t, padded_len))
    inverse = tl.load(_inverse_ptrs(inverse_ptr, bh, n, n_chunks, rows, C)).to(DT)  # T

    dw = tl.zeros([C, BK], dtype=tl.float32)
    d_outer = tl.zeros([C, C], dtype=tl.float32)  # dU~ U~^T, then + dW W^T
    dbeta = tl.zeros([C], dtype=tl.float32)
    for v0 in range(0, DV, BV):
        v_cols = v0 + tl.arange(0, BV)
        v_in = (v_cols < DV)[None, :]
        chunk_state, state_mask = _state_ptrs(states_ptr, bh * n_chunks + n, v_cols, k_cols, DV, DK)
        state = tl.load(chunk_state, mask=state_mask, other=0.0)
        du = tl.load(_workspace_ptrs(du_ptr, bh, t, v_cols, padded_len, DV), mask=v_in, other=0.0).to(DT)
        u_tilde = tl.load(_workspace_ptrs(u_tilde_ptr, bh, t, v_cols, padded_len, DV), mask=v_in, other=0.0)
        v = _load_tokens(v_ptr, b, h, t, t_mask, v_cols, T, H, DV)

        dw -= tl.dot(du, state, input_precision=PREC)
        d_rhs_values = tl.dot(tl.trans(inverse), du, input_precision=PREC)  # dB_V
        d_outer += tl.dot(du, tl.trans(u_tilde), input_precision=PREC)
        dbeta += tl.sum(v * d_rhs_values, axis=1)
        _store_tokens(dv_ptr, beta[:, None] * d_rhs_values, b, h, t, t_mask, v_cols, T, H, DV)

    k, _, _ = _normalize_rows(_load_tokens(k_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
    k_dt = k.to(DT)
    w = tl.load(_workspace_ptrs(w_ptr, bh, t, k_cols, padded_len, DK), mask=(k_cols < DK)[None, :], other=0.0)
    first, continues, _, _, _ = _chunk_documents(doc_start_ptr, b, n, t, t_mask, T, C, HAS_DOCS)
    decay = _from_start(g, continues, HAS_DOCS)
    strict = _decay_matrix(g, rows, first, True, HAS_DOCS)
    dw = dw.to(DT)
    d_outer += tl.dot(dw, tl.trans(w), input_precision=PREC)
    minus_da = tl.dot(tl.trans(inverse), d_outer.to(DT), input_precision=PREC)
    da = tl.where(rows[:, None] > rows[None, :], -minus_da, 0.0)
    d_rhs_keys = tl.dot(tl.trans(inverse), dw, input_precision=PREC)  # dB_K
    key_overlap = tl.dot(k_dt, tl.trans(k_dt), input_precision=PREC) * strict  # k_t.k_s exp(g_t - g_s), s < t
    d_overlap = (da * beta[:, None] * strict).to(DT)  # gradient of k_t.k_s through A
    dk = (
        (beta * decay)[:, None] * d_rhs_keys
        + tl.dot(d_overlap, k_dt, input_precision=PREC)
        + tl.dot(tl.trans(d_overlap), k_dt, input_precision=PREC)
    )
    tl.store(_workspace_ptrs(dk_partial_ptr, bh, t, k_cols, padded_len, DK), dk, mask=(k_cols < DK)[None, :])
    keys_dot_d_rhs = tl.sum(k * d_rhs_keys, axis=1)
    dbeta += decay * keys_dot_d_rhs + tl.sum(da * key_overlap, axis=1)
    tl.store(dbeta_ptr + gates, dbeta.to(dbeta_ptr.dtype.element_ty), mask=t_mask)
    # g's uses here, summed over t (the reverse cumsum to dlog_gamma waits for _grad_output_kernel's)
    through_a = da * beta[:, None] * key_overlap
    dg = tl.sum(through_a, axis=1) - tl.sum(through_a, axis=0) + beta * decay * keys_dot_d_rhs
    tl.store(_decay_ptrs(dg_partial_ptr, bh, t, padded_len), dg)


@_tune(GRAD_CONFIGS, key=["DK", "DV", "NORMALIZE", "HAS_DOCS"])
@triton.jit
def _grad_output_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    u_ptr,
    states_ptr,
    dstates_ptr,
    dr_ptr,
    dk_partial_ptr,
    dg_partial_ptr,
    dq_ptr,
    dk_ptr,
    dlog_gamma_ptr,
    T,
    doc_start_ptr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    C: tl.constexpr,
    NORMALIZE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PREC: tl.constexpr,
    BV: tl.constexpr,
):
    """Gradients through the output and the state recurrence, R = diag(G) Q S^T + (Q K^T * D) U and
    S_end = G_C S + U^T Kd: dq, then dk and dlog_gamma with _grad_transform_kernel's parts added, and
    the L2 normalisation's backward."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h, n_chunks, padded_len, rows = _head_layout(bh, T, H, C)
    t, t_mask = _chunk_tokens(n, rows, T, C)
    k_cols = tl.arange(0, BK)
    DT = u_ptr.dtype.element_ty

    g = tl.load(_decay_ptrs(g_ptr, bh, t, padded_len))
    g_end = _chunk_end_decay(g_ptr, bh, n, padded_len, C)
    d_qs = tl.zeros([C, BK], dtype=tl.float32)  # dR S: gradient of Q S^T's Q
    d_k_to_end = tl.zeros([C, BK], dtype=tl.float32)  # U dS_end
    d_scores = tl.zeros([C, C], dtype=tl.float32)  # dR U^T
    state_dot_dstate = tl.zeros([BK], dtype=tl.float32)  # sum(S * dS_end) over Dv, for d g_end through G_C S
    for v0 in range(0, DV, BV):
        v_cols = v0 + tl.arange(0, BV)
        v_in = (v_cols < DV)[None, :]
        chunk_state, state_mask = _state_ptrs(states_ptr, bh * n_chunks + n, v_cols, k_cols, DV, DK)
        state = tl.load(chunk_state, mask=state_mask, other=0.0)
        chunk_dstate = _state_ptrs(dstates_ptr, bh * n_chunks + n, v_cols, k_cols, DV, DK)[0]
        dstate = tl.load(chunk_dstate, mask=state_mask, other=0.0)
        u = tl.load(_workspace_ptrs(u_ptr, bh, t, v_cols, padded_len, DV), mask=v_in, other=0.0)
        dr = _load_tokens(dr_ptr, b, h, t, t_mask, v_cols, T, H, DV).to(DT)

        d_qs += tl.dot(dr, state, input_precision=PREC)
        d_k_to_end += tl.dot(u, dstate, input_precision=PREC)
        d_scores += tl.dot(dr, tl.trans(u), input_precision=PREC)
        state_dot_dstate += tl.sum(state.to(tl.float32) * dstate.to(tl.float32), axis=0)

    q, q_norm, q_denom = _normalize_rows(_load_tokens(q_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
    k, k_norm, k_denom = _normalize_rows(_load_tokens(k_ptr, b, h, t, t_mask, k_cols, T, H, DK), NORMALIZE)
    q_dt, k_dt = q.to(DT), k.to(DT)
    first, continues, in_last, no_reset, resets = _chunk_documents(doc_start_ptr, b, n, t, t_mask, T, C, HAS_DOCS)
    decay = _from_start(g, continues, HAS_DOCS)
    to_end, chunk_decay = _to_end(g, g_end, in_last, no_reset, HAS_DOCS)
    causal = _decay_matrix(g, rows, first, False, HAS_DOCS)
    scores = tl.dot(q_dt, tl.trans(k_dt), input_precision=PREC) * causal
    d_scores_decayed = (d_scores * causal).to(DT)
    dq = decay[:, None] * d_qs + tl.dot(d_scores_decayed, k_dt, input_precision=PREC)
    dg = tl.load(_decay_ptrs(dg_partial_ptr, bh, t, padded_len)) + decay * tl.sum(q * d_qs, axis=1)
    dq = _normalize_rows_backward(q, q_norm, q_denom, dq, NORMALIZE)
    _store_tokens(dq_ptr, dq, b, h, t, t_mask, k_cols, T, H, DK)

    dk = tl.load(_workspace_ptrs(dk_partial_ptr, bh, t, k_cols, padded_len, DK), mask=(k_cols < DK)[None, :], other=0.0)
    dk += tl.dot(tl.trans(d_scores_decayed), q_dt, input_precision=PREC) + to_end[:, None] * d_k_to_end
    through_scores = d_scores * scores
    through_to_end = to_end * tl.sum(k * d_k_to_end, axis=1)
    dg += tl.sum(through_scores, axis=1) - tl.sum(through_scores, axis=0) - through_to_end
    dg_end = chunk_decay * tl.sum(state_dot_dstate, axis=0) + tl.sum(through_to_end, axis=0)
    dg += tl.where(rows == C - 1, dg_end, 0.0)
    # every use of g summed over t; g_t = cumsum(log_gamma) turns that into a reverse cumsum
    dlog_gamma = tl.sum(dg, axis=0) - tl.cumsum(dg, axis=0) + dg
    if HAS_DOCS:  # the prepare kernel left the resets' log_gamma out of g
        dlog_gamma = tl.where(resets, 0.0, dlog_gamma)
    tl.store(dlog_gamma_ptr + _gate_offsets(b, h, t, T, H), dlog_gamma.to(dlog_gamma_ptr.dtype.element_ty), mask=t_mask)
    dk = _normalize_rows_backward(k, k_norm, k_denom, dk, NORMALIZE)
    _store_tokens(dk_ptr, dk, b, h, t, t_mask, k_cols, T, H, DK)


# ---------------------------------------------------------------------------------------------
# Launchers


def _dot_setup(q: torch.Tensor) -> tuple[torch.dtype, str]:
    """Operand dtype of the tensor-core products and their precision mode."""
    if q.dtype in (torch.bfloat16, torch.float16):
        return q.dtype, "tf32"  # ignored for half operands
    if q.dtype == torch.float32:
        return torch.float32, "ieee"
    raise TypeError(f"the Triton gated delta kernels take bf16, fp16 or fp32 inputs, got {q.dtype}")


def _inverse_precision(prec: str) -> str:
    """Precision of the (I + A)^{-1} doubling products: fp32-accurate either way (tf32x3 on the tensor cores)."""
    return "ieee" if prec == "ieee" else "tf32x3"


def _dims(q: torch.Tensor, v: torch.Tensor) -> dict:
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    return {
        "batch": batch,
        "seq_len": seq_len,
        "heads": heads,
        "key_dim": key_dim,
        "value_dim": value_dim,
        "n_chunks": triton.cdiv(seq_len, CHUNK),
        "bk": _block(key_dim),
        "bv_full": _block(value_dim),
    }


# What a training forward keeps for its backward, in this order: cumulative log decays g (fp32), the UT
# transform's inverse T, W, U~, the deltas U and every chunk's start state S (in the products' dtype).
WORKSPACES = ("g", "inverse", "w", "u_tilde", "u", "states")


def workspace_shapes(batch: int, seq_len: int, heads: int, key_dim: int, value_dim: int) -> dict[str, tuple]:
    """Shape of each of WORKSPACES: head-major (B * H, ...) tensors over the sequence padded to whole chunks."""
    bh, n_chunks = batch * heads, triton.cdiv(seq_len, CHUNK)
    padded_len = n_chunks * CHUNK
    return {
        "g": (bh, padded_len),
        "inverse": (bh, n_chunks, CHUNK, CHUNK),
        "w": (bh, padded_len, key_dim),
        "u_tilde": (bh, padded_len, value_dim),
        "u": (bh, padded_len, value_dim),
        "states": (bh, n_chunks, value_dim, key_dim),
    }


def new_workspaces(q, v, names) -> dict[str, torch.Tensor]:
    """Uninitialised workspaces `names` for inputs q, v: g in fp32, the rest in the products' dtype."""
    batch, seq_len, heads, key_dim = q.shape
    shapes = workspace_shapes(batch, seq_len, heads, key_dim, v.shape[-1])
    dot_dtype, _ = _dot_setup(q)
    return {n: q.new_empty(shapes[n], dtype=torch.float32 if n == "g" else dot_dtype) for n in names}


def _common(d: dict) -> dict:
    """The constexpr launch arguments every chunked kernel takes."""
    return {"H": d["heads"], "DK": d["key_dim"], "DV": d["value_dim"], "BK": d["bk"], "C": CHUNK}


def _documents(doc_start: torch.Tensor | None, log_gamma: torch.Tensor) -> dict:
    """The launch arguments every chunked kernel takes for document resets: doc_start as int32 and the
    HAS_DOCS switch; without documents log_gamma stands in for the pointer, never read."""
    if doc_start is None:
        return {"doc_start_ptr": log_gamma, "HAS_DOCS": False}
    return {"doc_start_ptr": doc_start.to(torch.int32).contiguous(), "HAS_DOCS": True}


def _new_reset_rows(docs: dict, batch: int, n_chunks: int) -> torch.Tensor:
    """reset_rows (B, n_chunks, 2) int32, each chunk's first and last reset rows (C and -1 where it holds none),
    for one direction (forward or backward): uninitialised, filled by its first chunk-parallel kernel
    (_store_reset_rows) for its sequential one (_chunk_resets). Without documents doc_start_ptr's stand-in,
    never read."""
    if not docs["HAS_DOCS"]:
        return docs["doc_start_ptr"]
    return docs["doc_start_ptr"].new_empty(batch, n_chunks, 2)


def _sequential(common: dict) -> dict:
    """The launch arguments of a sequential kernel: those of every kernel but doc_start (it reads reset_rows)."""
    return {name: value for name, value in common.items() if name != "doc_start_ptr"}


def _forward_workspaces(q, k, v, log_gamma, beta, initial_state, normalize_qk: bool, keep_inverse: bool, docs: dict):
    """Run _prepare_kernel and _state_fwd_kernel; everything the output (and with keep_inverse the backward) needs."""
    d = _dims(q, v)
    _, prec = _dot_setup(q)
    bh, n_chunks = d["batch"] * d["heads"], d["n_chunks"]
    ws = new_workspaces(q, v, [name for name in WORKSPACES if keep_inverse or name != "inverse"])
    final_state = q.new_empty(d["batch"], d["heads"], d["value_dim"], d["key_dim"], dtype=torch.float32)
    common = {**_common(d), **docs}
    reset_rows = _new_reset_rows(docs, d["batch"], n_chunks)
    _prepare_kernel[(n_chunks, bh)](
        k, v, log_gamma, beta, ws["g"], ws["inverse"] if keep_inverse else ws["w"], ws["w"], ws["u_tilde"],
        d["seq_len"], reset_rows_ptr=reset_rows, BVF=d["bv_full"], NORMALIZE=normalize_qk, PREC=prec,
        INV_PREC=_inverse_precision(prec), STORE_INVERSE=keep_inverse, num_warps=PREPARE_WARPS, **common,
    )  # fmt: skip
    _state_fwd_kernel[lambda meta: (triton.cdiv(d["value_dim"], meta["BV"]), bh)](
        k, ws["g"], ws["w"], ws["u_tilde"], ws["u"], ws["states"],
        initial_state if initial_state is not None else final_state, final_state, d["seq_len"], reset_rows,
        NORMALIZE=normalize_qk, HAS_INITIAL=initial_state is not None, PREC=prec, **_sequential(common),
    )  # fmt: skip
    return d, ws, final_state, common, prec


def _contiguous(*tensors):
    return [None if x is None else x.contiguous() for x in tensors]


def chunk_forward(
    q, k, v, log_gamma, beta, initial_state, normalize_qk: bool, keep_workspaces: bool = False, doc_start=None
):
    """(r (B, T, H, Dv) in v's dtype, final_state (B, H, Dv, Dk) fp32, workspaces): with keep_workspaces the
    tensors of WORKSPACES, in that order, for chunk_backward; else an empty tuple. doc_start (B, T) int, or
    None: the state is zeroed before each document start (kernels/documents.py)."""
    q, k, v, log_gamma, beta, initial_state = _contiguous(q, k, v, log_gamma, beta, initial_state)
    batch, seq_len, heads, key_dim = q.shape
    if seq_len == 0:
        r, final_state = _empty_sequence(q, v, initial_state)
        return r, final_state, tuple(new_workspaces(q, v, WORKSPACES).values()) if keep_workspaces else ()
    d, ws, final_state, common, prec = _forward_workspaces(
        q, k, v, log_gamma, beta, initial_state, normalize_qk, keep_workspaces, _documents(doc_start, log_gamma)
    )
    r = torch.empty_like(v)
    _output_kernel[lambda meta: (d["n_chunks"], batch * heads, triton.cdiv(d["value_dim"], meta["BV"]))](
        q, k, ws["g"], ws["u"], ws["states"], r, seq_len, NORMALIZE=normalize_qk, PREC=prec, **common
    )
    return r, final_state, tuple(ws[name] for name in WORKSPACES) if keep_workspaces else ()


def chunk_backward(q, k, v, log_gamma, beta, workspaces, dr, dfinal, normalize_qk: bool, doc_start=None):
    """Gradients (dq, dk, dv, dlog_gamma, dbeta, dinitial_state fp32) of chunk_forward, given the workspaces
    its training forward kept (keep_workspaces=True) and the same doc_start."""
    q, k, v, log_gamma, beta, dr, dfinal = _contiguous(q, k, v, log_gamma, beta, dr, dfinal)
    batch, seq_len, heads, key_dim = q.shape
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dlog_gamma, dbeta = torch.empty_like(log_gamma), torch.empty_like(beta)
    if seq_len == 0:
        return dq, dk, dv, dlog_gamma, dbeta, dfinal.float().clone()
    d = _dims(q, v)
    _, prec = _dot_setup(q)
    common = {**_common(d), **_documents(doc_start, log_gamma)}
    ws = dict(zip(WORKSPACES, workspaces, strict=True))
    bh, n_chunks = batch * heads, d["n_chunks"]
    du_local = torch.empty(ws["u"].shape, device=q.device, dtype=torch.float32)
    du = torch.empty_like(du_local)
    dstates = torch.empty_like(ws["states"])
    dinitial = torch.empty_like(dfinal, dtype=torch.float32)

    reset_rows = _new_reset_rows(common, batch, n_chunks)
    _dv_local_kernel[lambda meta: (n_chunks, bh, triton.cdiv(d["value_dim"], meta["BV"]))](
        q, k, ws["g"], dr, du_local, seq_len, reset_rows_ptr=reset_rows, NORMALIZE=normalize_qk, PREC=prec, **common
    )
    _state_bwd_kernel[lambda meta: (triton.cdiv(d["value_dim"], meta["BV"]), bh)](
        q, k, ws["g"], ws["w"], dr, du_local, du, dstates, dfinal, dinitial, seq_len, reset_rows,
        NORMALIZE=normalize_qk, PREC=prec, **_sequential(common),
    )  # fmt: skip
    dk_partial = torch.empty(ws["w"].shape, device=q.device, dtype=torch.float32)
    dg_partial = torch.empty_like(ws["g"])
    _grad_transform_kernel[(n_chunks, bh)](
        k, v, beta, ws["g"], ws["inverse"], ws["w"], ws["u_tilde"], du, ws["states"], dk_partial, dg_partial,
        dv, dbeta, seq_len, NORMALIZE=normalize_qk, PREC=prec, **common,
    )  # fmt: skip
    _grad_output_kernel[(n_chunks, bh)](
        q, k, ws["g"], ws["u"], ws["states"], dstates, dr, dk_partial, dg_partial, dq, dk, dlog_gamma, seq_len,
        NORMALIZE=normalize_qk, PREC=prec, **common,
    )  # fmt: skip
    return dq, dk, dv, dlog_gamma, dbeta, dinitial


def _empty_sequence(q, v, initial_state):
    batch, _, heads, key_dim = q.shape
    if initial_state is None:
        final_state = q.new_zeros(batch, heads, v.shape[-1], key_dim, dtype=torch.float32)
    else:
        final_state = initial_state.float().clone()
    return torch.empty_like(v), final_state
