"""Fused Polar attention in Triton: forward, backward preamble, dq and dk/dv kernels, host launchers.

The kernels compute exactly what the streaming reference (`reference.py`) computes; read its module
docstring for the math. Only the Triton code and its launchers live here; the torch.library ops and
the `polar_attention(..., impl=)` entry point are in ops.py. Importing this module imports triton:
on CPU that only works with TRITON_INTERPRET=1 set beforehand (`backends.INTERPRET`).
Conventions shared by every kernel here:

- q, g_acc, c: (B, Tq, H, D); k, v: (B, Tk, Hkv, D), last dimension contiguous. Query head h reads
  KV head h // GROUP directly (no repeated K/V). Query row i sits at key position Tk - Tq + i.
- Per-query statistics are fp32 (B, H, Tq) contiguous.
- Logits are handled in base 2: a2 = q.k * temp * scale * log2(e), so the softmax uses exp2.
- Key (or query) tiles are visited in three segments: tiles cut by the window's lower edge (masked),
  tiles every query of the block sees (no mask), and the causal diagonal / ragged tail (masked).
  Tiles with no visible entry are never visited.
- Documents (DOCUMENTS, a constexpr: without it the kernels compile as before): doc_start (B, Tk) int32
  (kernels/documents.py). A query block's key loop starts at the tile of its first row's doc_start and
  its unmasked segment at its last row's; a key tile's query loop ends at its last key's document end
  (document_ends, computed once per backward) and its unmasked segment before its first key's. Masked
  tiles add k >= doc_start[q]; n (temp, null floor, the count) is each row's own document count.
- Per-head scalars arrive already transformed (softplus etc. done in PyTorch), as fp32 (H,) tensors.

Everything is reduced in fp32; only tl.dot operands are in the input dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from atma_titan.kernels import resources
from atma_titan.kernels.backends import AUTOTUNE, COPY_ENGINE, INTERPRET
from atma_titan.kernels.documents import document_ends
from atma_titan.kernels.polar.reference import visible_key_counts
from atma_titan.kernels.polar.triton_math import log1p, sigmoid, tanh_nonneg

# constexpr globals: the only kind a @triton.jit function may read
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
NORM_EPS = tl.constexpr(1e-6)


# ----------------------------------------------------------------------------------------------
# Autotune configurations: one small config under the interpreter (several crash it there)
# ----------------------------------------------------------------------------------------------


def _configs(cuda_choices, interpret_choice):
    """Configs from (BLOCK_M, BLOCK_N, num_warps, num_stages, SPLIT_MASK) tuples: the interpreter's one
    choice, else the CUDA ones, in order of preference. At launch they are pruned to those whose compiled
    shared memory fits the device (resources.autotune: an L4 has 99 KiB a block, an H200 227 KiB); without
    backends.AUTOTUNE (ATMA_TRITON_AUTOTUNE=0) the first of those runs, untuned.

    SPLIT_MASK: separate loops for masked and fully visible tiles (no mask arithmetic on most tiles), or
    one masked loop (less code for the register allocator; it can spill less).
    """
    choices = [interpret_choice] if INTERPRET else cuda_choices
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "SPLIT_MASK": split}, num_warps=w, num_stages=s, pre_hook=_descriptor_blocks
        )
        for bm, bn, w, s, split in choices
    ]


# the kernels' tensor-descriptor arguments (Hopper) and the tile rows each moves at a time
_DESCRIPTOR_ROWS = {"K_DESC": "BLOCK_N", "V_DESC": "BLOCK_N", "Q_DESC": "BLOCK_M", "GACC_DESC": "BLOCK_M"}


def _descriptor_blocks(nargs) -> None:
    """A config's hook: each descriptor argument moves its config's tile, the rows of one head."""
    for name, rows in _DESCRIPTOR_ROWS.items():
        if isinstance(nargs.get(name), TensorDescriptor):
            nargs[name].block_shape = [1, nargs[rows], 1, nargs["HEAD_DIM"]]


FWD_CONFIGS = _configs(
    [
        (128, 64, 8, 3, True),
        (128, 128, 8, 3, True),
        (128, 64, 8, 4, True),
        (128, 128, 8, 2, True),
        (64, 64, 4, 3, True),
        (128, 64, 8, 3, False),
        (128, 128, 8, 3, False),
    ],
    (16, 16, 1, 1, True),
)
# dk/dv: BLOCK_N keys per program, BLOCK_M queries per step
DKDV_CONFIGS = _configs(
    [
        (32, 128, 8, 2, True),
        (64, 128, 8, 2, True),
        (64, 64, 8, 2, True),
        (32, 64, 4, 3, True),
        (32, 128, 8, 2, False),
        (64, 64, 8, 2, False),
        (64, 128, 8, 2, False),
        (32, 128, 4, 5, True),
        (32, 128, 4, 3, False),
    ],
    (16, 16, 1, 1, True),
)
# dq: BLOCK_M queries per program, BLOCK_N keys per step
DQ_CONFIGS = _configs(
    [
        (128, 32, 8, 2, True),
        (128, 64, 8, 2, True),
        (128, 64, 8, 3, True),
        (64, 64, 4, 3, True),
        (128, 32, 8, 2, False),
        (128, 64, 8, 2, False),
        (128, 32, 4, 5, True),
        (128, 32, 4, 3, False),
    ],
    (16, 16, 1, 1, True),
)
TUNING_KEY = ["TQ_BUCKET", "TK_BUCKET", "HEAD_DIM", "GROUP", "DOCUMENTS"]
PREAMBLE_BLOCK_M = 16
PREAMBLE_WARPS = 4


# ----------------------------------------------------------------------------------------------
# Small scalar helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _visible_counts(q_pos, window):
    """n_i = pos_i + 1 keys, at most `window` of them when window > 0 (fp32). With documents pos_i is the
    position in the query's document (pos_i - doc_start)."""
    n = q_pos + 1
    n = tl.where(window > 0, tl.minimum(n, window), n)
    return n.to(tl.float32)


@triton.jit
def _row_doc_starts(doc_base, q_pos, Tk):
    """doc_start of the query rows at key positions q_pos; padded rows (past Tk) read the last position."""
    return tl.load(doc_base + tl.minimum(q_pos, Tk - 1))


@triton.jit
def _row_documents(doc_base, q_pos, Tk, window, DOCUMENTS: tl.constexpr):
    """Each query row's first visible position (its doc_start; q_pos, unread, without DOCUMENTS) and its
    visible key count n."""
    if DOCUMENTS:
        row_first = _row_doc_starts(doc_base, q_pos, Tk)
        n = _visible_counts(q_pos - row_first, window)
    else:
        row_first = q_pos
        n = _visible_counts(q_pos, window)
    return row_first, n


@triton.jit
def _visibility(q_pos, k_pos, window):
    """(M, N) bool from (M, 1) query and (1, N) key positions: causal, optionally windowed."""
    vis = k_pos <= q_pos
    return vis & ((window == 0) | (k_pos > q_pos - window))


@triton.jit
def _document_visibility(q_pos, k_pos, window, row_first, DOCUMENTS: tl.constexpr):
    """_visibility, and with documents only keys at or after the row's document start (row_first, as q_pos)."""
    vis = _visibility(q_pos, k_pos, window)
    if DOCUMENTS:
        vis = vis & (k_pos >= row_first)
    return vis


@triton.jit
def _tile(base, n_rows, start, stride_row, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Pointers to rows [start, start + BLOCK) of a (n_rows, HEAD_DIM) matrix with unit column stride, and
    the in-bounds row mask."""
    rows = start + tl.arange(0, BLOCK)
    return base + rows[:, None] * stride_row + tl.arange(0, HEAD_DIM)[None, :], (rows < n_rows)[:, None]


@triton.jit
def _load_tile(tile, MASKED: tl.constexpr):
    ptrs, row_ok = tile
    if MASKED:
        return tl.load(ptrs, mask=row_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _store_tile(tile, x):
    ptrs, row_ok = tile
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=row_ok)


@triton.jit
def _rows_of_head(src, b, head, start, base_stride, n_rows, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MASKED: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """Rows [start, start + BLOCK) of one head of a (B, T, H, D) tensor: through its descriptor `src` with TMA
    (the copy engine; rows past the end arrive as 0), else from `src`, a pointer to batch b's head `head`
    (rows base_stride apart; rows past n_rows are 0 when MASKED)."""
    if TMA:
        return src.load([b, start, head, 0]).reshape(BLOCK, HEAD_DIM)
    else:
        return _load_tile(_tile(src, n_rows, start, base_stride, BLOCK, HEAD_DIM), MASKED)


@triton.jit
def _key_value_tiles(k_src, v_src, b, kvh, start_n, stride_kt, stride_vt, Tk, BLOCK_N: tl.constexpr,
                     HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    k = _rows_of_head(k_src, b, kvh, start_n, stride_kt, Tk, BLOCK_N, HEAD_DIM, MASKED, TMA)
    v = _rows_of_head(v_src, b, kvh, start_n, stride_vt, Tk, BLOCK_N, HEAD_DIM, MASKED, TMA)
    return k, v


@triton.jit
def _key_segments(first_pos, last_pos, window, doc_first, doc_last, BLOCK_N: tl.constexpr, DOCUMENTS: tl.constexpr):
    """Key-tile bounds for query positions first_pos..last_pos (all valid, last_pos < Tk); with documents
    doc_first, doc_last are doc_start at first_pos and at last_pos (unread without).

    Returns (lo, full_lo, full_hi, hi): masked tiles [lo, min(full_lo, hi)), unmasked tiles
    [full_lo, full_hi), masked tiles [max(full_lo, full_hi), hi). lo, full_lo, full_hi are tile-aligned.
    """
    hi = last_pos + 1
    has_window = window > 0
    lo = tl.where(has_window, (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N, 0)
    # first tile inside every row's window: its first key must be > last_pos - window
    edge = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
    full_lo = tl.where(has_window, tl.maximum(edge, lo), lo)
    full_hi = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # tiles wholly at or before the first row
    if DOCUMENTS:
        # doc_start does not decrease: no row sees a key before the first row's document start (skipped),
        # and every row sees the keys from the last row's document start on (unmasked)
        lo = tl.maximum(lo, (doc_first // BLOCK_N) * BLOCK_N)
        full_lo = tl.maximum(full_lo, tl.cdiv(doc_last, BLOCK_N) * BLOCK_N)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_segments(
    first_key, last_key, offset, Tq, window, end_first, end_last, BLOCK_M: tl.constexpr, DOCUMENTS: tl.constexpr
):
    """Query-tile bounds (row indices) for the key range first_key..last_key, as in _key_segments; with
    documents end_first, end_last are the exclusive document ends of first_key and last_key (unread without)."""
    lo = (tl.maximum(first_key - offset, 0) // BLOCK_M) * BLOCK_M
    hi = tl.where(window > 0, tl.minimum(Tq, last_key + window - offset), Tq)
    # rows at or after the last key see the whole tile causally
    full_lo = tl.cdiv(tl.maximum(last_key - offset, 0), BLOCK_M) * BLOCK_M
    full_hi = (Tq // BLOCK_M) * BLOCK_M
    # with a window the block's last row must still see the first key: row + offset < first_key + window
    window_hi = (tl.maximum(first_key + window - offset, 0) // BLOCK_M) * BLOCK_M
    full_hi = tl.where(window > 0, tl.minimum(full_hi, window_hi), full_hi)
    if DOCUMENTS:
        # no row past the last key's document sees the tile (skipped); rows before the first key's
        # document end see all of it (unmasked)
        hi = tl.minimum(hi, end_last - offset)
        full_hi = tl.minimum(full_hi, (tl.maximum(end_first - offset, 0) // BLOCK_M) * BLOCK_M)
    return lo, full_lo, full_hi, hi


# ----------------------------------------------------------------------------------------------
# Program preambles (program ids and base pointers shared by several kernels)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _batch_and_head(pid, n_heads):
    """(batch, head) of a program index over batch x heads, batch-major."""
    return pid // n_heads, pid % n_heads


@triton.jit
def _query_tile_program(Tq, Tk, H, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program over (query tile, batch x head): start_m, pid_bh, b, h, its KV head and the query offset.

    The heaviest (latest) query tiles come first: better tail balance under causal masking."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    pid_bh = tl.program_id(1)
    b, h = _batch_and_head(pid_bh, H)
    kvh = h // GROUP
    offset = Tk - Tq
    return start_m, pid_bh, b, h, kvh, offset


@triton.jit
def _key_sweep(
    K,
    V,
    b,
    kvh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    offset,
    start_m,
    Tk,
    window,
    doc_base,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOCUMENTS: tl.constexpr,
):
    """K and V of KV head kvh in batch b, and the key-tile segments (_key_segments) of query tile start_m;
    doc_base: batch b's doc_start row (read with DOCUMENTS only)."""
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    first_pos = offset + start_m
    last_pos = tl.minimum(first_pos + BLOCK_M - 1, Tk - 1)
    if DOCUMENTS:
        doc_first = tl.load(doc_base + first_pos)
        doc_last = tl.load(doc_base + last_pos)
    else:
        doc_first = 0
        doc_last = 0
    lo, full_lo, full_hi, hi = _key_segments(first_pos, last_pos, window, doc_first, doc_last, BLOCK_N, DOCUMENTS)
    return k_base, v_base, lo, full_lo, full_hi, hi


@triton.jit
def _query_sweep(
    end_base, start_n, Tq, Tk, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOCUMENTS: tl.constexpr
):
    """The query-tile segments (_query_segments) of key tile start_n; end_base: the batch's document ends
    (kernels/documents.document_ends; read with DOCUMENTS only)."""
    last_key = tl.minimum(start_n + BLOCK_N, Tk) - 1
    if DOCUMENTS:
        end_first = tl.load(end_base + start_n)
        end_last = tl.load(end_base + last_key)
    else:
        end_first = Tk
        end_last = Tk
    return _query_segments(start_n, last_key, Tk - Tq, Tq, window, end_first, end_last, BLOCK_M, DOCUMENTS)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_key_tiles(
    acc,
    l,
    q2,
    m,
    q,
    row_scale,
    q_pos,
    row_first,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    lo,
    hi,
    Tk,
    window,
    offs_n,
    b,
    kvh,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Online softmax over key tiles [lo, hi): running max m, l = sum p, q2 = sum p^2, acc = sum p v. With TMA
    k_base, v_base are descriptors of the whole K and V (the copy engine moves the tiles; rows past Tk read
    as 0), else pointers to batch b's KV head kvh."""
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + offs_n
        k, v = _key_value_tiles(
            k_base, v_base, b, kvh, start_n, stride_kt, stride_vt, Tk, BLOCK_N, HEAD_DIM, MASKED, TMA
        )
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            vis = _document_visibility(q_pos[:, None], k_pos[None, :], window, row_first[:, None], DOCUMENTS)
            vis = vis & (k_pos < Tk)[None, :]
            qk = tl.where(vis, qk, float("-inf"))
        # a = qk row_scale (row_scale > 0): its max from qk's, and the exponent in one FMA per entry
        m_new = tl.maximum(m, tl.max(qk, 1) * row_scale)
        rescale = tl.math.exp2(m - m_new)
        p = tl.math.exp2(qk * row_scale[:, None] - m_new[:, None])
        l = l * rescale + tl.sum(p, 1)
        q2 = q2 * (rescale * rescale) + tl.sum(p * p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None], input_precision=DOT_PRECISION)
        m = m_new
    return acc, l, q2, m


@resources.autotune(FWD_CONFIGS, key=TUNING_KEY, single=not AUTOTUNE)
@triton.jit
def polar_fwd_kernel(
    Q,
    K,
    V,
    C,
    MAG,
    LSE,
    NEFF,
    SNORM,
    SP_ALPHA,
    NULL_BASE,
    SP_GAMMA,
    SP_BETA,
    V_NULL,
    DOC_START,
    K_DESC,
    V_DESC,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_mb,
    stride_mt,
    stride_mh,
    Tq,
    Tk,
    H,
    window,
    sm_scale,
    TQ_BUCKET,  # autotuning key only: lengths rounded up to a power of two
    TK_BUCKET,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
):
    """K_DESC, V_DESC: with TMA (Hopper) the descriptors of K and V, else unread stand-ins."""
    start_m, pid_bh, b, h, kvh, offset = _query_tile_program(Tq, Tk, H, GROUP, BLOCK_M)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Tq
    q_pos = offset + offs_m

    q = _load_tile(_tile(Q + b * stride_qb + h * stride_qh, Tq, start_m, stride_qt, BLOCK_M, HEAD_DIM), True)
    sp_alpha = tl.load(SP_ALPHA + h)
    doc_base = DOC_START + b * Tk
    row_first, n = _row_documents(doc_base, q_pos, Tk, window, DOCUMENTS)
    temp = 1.0 + sp_alpha * tl.log(n)
    row_scale = temp * (sm_scale * LOG2E)

    k_base, v_base, lo, full_lo, full_hi, hi = _key_sweep(
        K, V, b, kvh, stride_kb, stride_kh, stride_vb, stride_vh, offset, start_m, Tk, window, doc_base,
        BLOCK_M, BLOCK_N, DOCUMENTS,
    )  # fmt: skip

    # a finite start for m: rows whose first tiles are all masked keep rescale = 1, p = 0
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    q2 = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if TMA:
        k_base = K_DESC
        v_base = V_DESC
    args = (q_pos, row_first, k_base, v_base, stride_kt, stride_vt)
    if SPLIT_MASK:
        acc, l, q2, m = _fwd_key_tiles(
            acc, l, q2, m, q, row_scale, *args, lo, tl.minimum(full_lo, hi), Tk, window, offs_n, b, kvh,
            HEAD_DIM, True, BLOCK_N, DOT_PRECISION, DOCUMENTS, TMA,
        )  # fmt: skip
        acc, l, q2, m = _fwd_key_tiles(
            acc, l, q2, m, q, row_scale, *args, full_lo, full_hi, Tk, window, offs_n, b, kvh,
            HEAD_DIM, False, BLOCK_N, DOT_PRECISION, DOCUMENTS, TMA,
        )  # fmt: skip
        acc, l, q2, m = _fwd_key_tiles(
            acc, l, q2, m, q, row_scale, *args, tl.maximum(full_lo, full_hi), hi, Tk, window, offs_n, b,
            kvh, HEAD_DIM, True, BLOCK_N, DOT_PRECISION, DOCUMENTS, TMA,
        )  # fmt: skip
    else:
        acc, l, q2, m = _fwd_key_tiles(
            acc, l, q2, m, q, row_scale, *args, lo, hi, Tk, window, offs_n, b, kvh,
            HEAD_DIM, True, BLOCK_N, DOT_PRECISION, DOCUMENTS, TMA,
        )  # fmt: skip

    # fold in the null entry through keep = l / Z = sigmoid(lse - a_N); e^(a_N - m) is never formed
    l = tl.where(l > 0, l, 1.0)  # padded rows only
    q2 = tl.where(q2 > 0, q2, 1.0)
    lse = (m + tl.math.log2(l)) * LN2
    null_logit = temp * (tl.load(NULL_BASE + h) + tl.load(SP_GAMMA + h) * tl.sqrt(tl.log(1.0 + n)))
    keep = sigmoid(lse - null_logit)
    w_null = sigmoid(null_logit - lse)
    v_null = tl.load(V_NULL + h * HEAD_DIM + offs_d)
    s_vec = acc * (keep / l)[:, None] + w_null[:, None] * v_null[None, :]
    s_norm = tl.sqrt(tl.sum(s_vec * s_vec, 1))
    c = s_vec / tl.maximum(s_norm, NORM_EPS)[:, None]
    n_eff = l * l / q2
    mag = tanh_nonneg(tl.load(SP_BETA + h) * log1p(n_eff * keep))

    c_tile = _tile(C + b * stride_cb + h * stride_ch, Tq, start_m, stride_ct, BLOCK_M, HEAD_DIM)
    _store_tile(c_tile, c)
    tl.store(MAG + b * stride_mb + h * stride_mh + offs_m * stride_mt, mag.to(MAG.dtype.element_ty), mask=row_ok)
    stats = pid_bh * Tq + offs_m
    tl.store(LSE + stats, lse, mask=row_ok)
    tl.store(NEFF + stats, n_eff, mask=row_ok)
    tl.store(SNORM + stats, s_norm, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Backward preamble: per-query scalars (reference `_Preamble`)
# ----------------------------------------------------------------------------------------------


@triton.jit
def polar_bwd_preamble_kernel(
    C,
    GC,
    GMAG,
    LSE,
    NEFF,
    SNORM,
    SP_ALPHA,
    NULL_BASE,
    SP_GAMMA,
    SP_BETA,
    V_NULL,
    DOC_START,
    GACC,
    LSE2,
    DS_SCALE,
    DPC,
    GQ2,
    DA_NULL,
    DELTA_REST,
    KEEP,
    DMAG_BETA_ROW,
    DVNULL_PART,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_gcb,
    stride_gct,
    stride_gch,
    stride_gmb,
    stride_gmt,
    stride_gmh,
    stride_ab,
    stride_at,
    stride_ah,
    Tq,
    Tk,
    H,
    window,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = _batch_and_head(pid_bh, H)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Tq
    rows2d = offs_m[:, None]
    mask2d = row_ok[:, None]

    c = tl.load(C + b * stride_cb + h * stride_ch + rows2d * stride_ct + offs_d[None, :], mask=mask2d, other=0.0)
    c = c.to(tl.float32)
    g_c = tl.load(GC + b * stride_gcb + h * stride_gch + rows2d * stride_gct + offs_d[None, :], mask=mask2d, other=0.0)
    g_c = g_c.to(tl.float32)
    g_mag = tl.load(GMAG + b * stride_gmb + h * stride_gmh + offs_m * stride_gmt, mask=row_ok, other=0.0)
    g_mag = g_mag.to(tl.float32)
    stats = pid_bh * Tq + offs_m
    lse = tl.load(LSE + stats, mask=row_ok, other=0.0)
    n_eff = tl.load(NEFF + stats, mask=row_ok, other=1.0)
    s_norm = tl.load(SNORM + stats, mask=row_ok, other=1.0)

    q_pos = Tk - Tq + offs_m
    _, n = _row_documents(DOC_START + b * Tk, q_pos, Tk, window, DOCUMENTS)
    temp = 1.0 + tl.load(SP_ALPHA + h) * tl.log(n)
    null_logit = temp * (tl.load(NULL_BASE + h) + tl.load(SP_GAMMA + h) * tl.sqrt(tl.log(1.0 + n)))
    keep = sigmoid(lse - null_logit)
    w_null = sigmoid(null_logit - lse)
    m_eff = n_eff * keep
    log1p_m_eff = log1p(m_eff)
    sp_beta = tl.load(SP_BETA + h)
    mag = tanh_nonneg(sp_beta * log1p_m_eff)

    # c = s_vec / max(||s_vec||, eps): project out the radial part unless the norm was clamped
    clamped_norm = tl.maximum(s_norm, NORM_EPS)
    radial = tl.where(s_norm > NORM_EPS, tl.sum(g_c * c, 1), 0.0)
    g_s = (g_c - radial[:, None] * c) / clamped_norm[:, None]
    delta = tl.sum(g_s * c, 1) * clamped_norm  # g_s . s_vec: zero unless clamped
    g_me = g_mag * sp_beta * (1.0 - mag * mag) / (1.0 + m_eff)
    g_l = g_me * m_eff * (3.0 - keep)
    g_q2 = -g_me * m_eff * n_eff
    v_null = tl.load(V_NULL + h * HEAD_DIM + offs_d)
    g_s_dot_v_null = tl.sum(g_s * v_null[None, :], 1)
    da_null = w_null * (g_s_dot_v_null - delta - g_me * m_eff)

    tl.store(
        GACC + b * stride_ab + h * stride_ah + rows2d * stride_at + offs_d[None, :],
        (keep[:, None] * g_s).to(GACC.dtype.element_ty),
        mask=mask2d,
    )
    tl.store(LSE2 + stats, lse * LOG2E, mask=row_ok)
    # d a / d(q.k) = temp * scale, read by the dk/dv sweep (which would otherwise take a log per tile)
    tl.store(DS_SCALE + stats, temp * sm_scale, mask=row_ok)
    tl.store(DPC + stats, g_l - keep * delta, mask=row_ok)
    tl.store(GQ2 + stats, g_q2, mask=row_ok)
    tl.store(DA_NULL + stats, da_null, mask=row_ok)
    # the dq kernel replaces delta by A + this, with A from its own products (reference._consistent_delta_fix)
    tl.store(DELTA_REST + stats, w_null * g_s_dot_v_null - delta, mask=row_ok)
    tl.store(KEEP + stats, keep, mask=row_ok)
    tl.store(DMAG_BETA_ROW + stats, g_mag * (1.0 - mag * mag) * log1p_m_eff, mask=row_ok)
    # this tile's share of d v_null = sum_i w_null g_s
    part = tl.sum(tl.where(mask2d, w_null[:, None] * g_s, 0.0), 0)
    tl.store(DVNULL_PART + (pid_bh * tl.num_programs(0) + pid_m) * HEAD_DIM + offs_d, part)


# ----------------------------------------------------------------------------------------------
# Backward: dq (and sum_j da_j s_j, da_N per query), one program per query tile and query head
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dq_key_tiles(
    dq,
    da_s,
    p_g,
    p_s,
    q,
    g_acc,
    row_scale,
    lse2,
    dp_const,
    g_q2,
    q_pos,
    row_first,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    lo,
    hi,
    Tk,
    window,
    offs_n,
    b,
    kvh,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Key tiles [lo, hi) of one query tile: dq += da k and the three row sums. k_base, v_base as in
    _fwd_key_tiles."""
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + offs_n
        k, v = _key_value_tiles(
            k_base, v_base, b, kvh, start_n, stride_kt, stride_vt, Tk, BLOCK_N, HEAD_DIM, MASKED, TMA
        )
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        a = qk * row_scale[:, None] - lse2[:, None]
        if MASKED:
            vis = _document_visibility(q_pos[:, None], k_pos[None, :], window, row_first[:, None], DOCUMENTS)
            vis = vis & (k_pos < Tk)[None, :]
            a = tl.where(vis, a, float("-inf"))
        p = tl.math.exp2(a)  # weights among the real keys, normalised to l = 1
        p_dp = p * tl.dot(g_acc, tl.trans(v), input_precision=DOT_PRECISION)
        da = p_dp + p * (dp_const[:, None] + 2.0 * g_q2[:, None] * p)
        da_s += tl.sum(da * qk, 1)
        p_g += tl.sum(p_dp, 1)  # A = sum_j p_j g_acc.v_j
        p_s += tl.sum(p * qk, 1)  # S0 = sum_j p_j q.k_j
        dq = tl.dot(da.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq, da_s, p_g, p_s


@resources.autotune(DQ_CONFIGS, key=TUNING_KEY, single=not AUTOTUNE)
@triton.jit
def polar_bwd_dq_kernel(
    Q,
    K,
    V,
    GACC,
    LSE2,
    DPC,
    GQ2,
    DELTA_REST,
    KEEP,
    DA_NULL_IN,
    SP_ALPHA,
    DOC_START,
    DQ,
    DA_S,
    DA_NULL,
    K_DESC,
    V_DESC,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    Tq,
    Tk,
    H,
    window,
    sm_scale,
    TQ_BUCKET,  # autotuning key only: lengths rounded up to a power of two
    TK_BUCKET,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
):
    start_m, pid_bh, b, h, kvh, offset = _query_tile_program(Tq, Tk, H, GROUP, BLOCK_M)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < Tq
    q_pos = offset + offs_m
    # q, g_acc and dq share one (B, Tq, H, D) layout
    row_off = b * stride_qb + h * stride_qh
    q = _load_tile(_tile(Q + row_off, Tq, start_m, stride_qt, BLOCK_M, HEAD_DIM), True)
    g_acc = _load_tile(_tile(GACC + row_off, Tq, start_m, stride_qt, BLOCK_M, HEAD_DIM), True)
    stats = pid_bh * Tq + offs_m
    lse2 = tl.load(LSE2 + stats, mask=row_ok, other=0.0)
    dp_const = tl.load(DPC + stats, mask=row_ok, other=0.0)
    g_q2 = tl.load(GQ2 + stats, mask=row_ok, other=0.0)
    doc_base = DOC_START + b * Tk
    row_first, n = _row_documents(doc_base, q_pos, Tk, window, DOCUMENTS)
    temp = 1.0 + tl.load(SP_ALPHA + h) * tl.log(n)
    row_scale = temp * (sm_scale * LOG2E)

    k_base, v_base, lo, full_lo, full_hi, hi = _key_sweep(
        K, V, b, kvh, stride_kb, stride_kh, stride_vb, stride_vh, offset, start_m, Tk, window, doc_base,
        BLOCK_M, BLOCK_N, DOCUMENTS,
    )  # fmt: skip

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # row sums: da_s = sum_j da_j q.k_j, p_g = sum_j p_j g_acc.v_j, p_s = sum_j p_j q.k_j
    da_s = tl.zeros([BLOCK_M], tl.float32)
    p_g = tl.zeros([BLOCK_M], tl.float32)
    p_s = tl.zeros([BLOCK_M], tl.float32)
    if TMA:
        k_base = K_DESC
        v_base = V_DESC
    args = (q, g_acc, row_scale, lse2, dp_const, g_q2, q_pos, row_first, k_base, v_base, stride_kt, stride_vt)
    if SPLIT_MASK:
        dq, da_s, p_g, p_s = _dq_key_tiles(
            dq, da_s, p_g, p_s, *args, lo, tl.minimum(full_lo, hi), Tk, window, offs_n, b, kvh, HEAD_DIM, True,
            BLOCK_N, DOT_PRECISION, DOCUMENTS, TMA,
        )  # fmt: skip
        dq, da_s, p_g, p_s = _dq_key_tiles(
            dq, da_s, p_g, p_s, *args, full_lo, full_hi, Tk, window, offs_n, b, kvh, HEAD_DIM, False,
            BLOCK_N, DOT_PRECISION, DOCUMENTS, TMA,
        )  # fmt: skip
        dq, da_s, p_g, p_s = _dq_key_tiles(
            dq, da_s, p_g, p_s, *args, tl.maximum(full_lo, full_hi), hi, Tk, window, offs_n, b, kvh, HEAD_DIM, True,
            BLOCK_N, DOT_PRECISION, DOCUMENTS, TMA,
        )  # fmt: skip
    else:
        dq, da_s, p_g, p_s = _dq_key_tiles(
            dq, da_s, p_g, p_s, *args, lo, hi, Tk, window, offs_n, b, kvh, HEAD_DIM, True, BLOCK_N,
            DOT_PRECISION, DOCUMENTS, TMA,
        )  # fmt: skip
    # ds = temp * da * scale is the gradient with respect to q.k
    dq = dq * (temp * sm_scale)[:, None]
    dq_tile = _tile(DQ + row_off, Tq, start_m, stride_qt, BLOCK_M, HEAD_DIM)
    _store_tile(dq_tile, dq)
    # the per-head scalars take delta' = A + delta_rest, consistent with this sweep's g_acc.v_j products
    # (reference._consistent_delta_fix): sum_j da_j s_j moves by -keep r S0 and da_N by -w_N r
    r = p_g + tl.load(DELTA_REST + stats, mask=row_ok, other=0.0)
    keep = tl.load(KEEP + stats, mask=row_ok, other=1.0)
    tl.store(DA_S + stats, (da_s - keep * r * p_s) * sm_scale, mask=row_ok)
    da_null = tl.load(DA_NULL_IN + stats, mask=row_ok, other=0.0)
    tl.store(DA_NULL + stats, da_null - (1.0 - keep) * r, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Backward: dk, dv, one program per key tile and KV head, summing its GROUP query heads
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_query_tiles(
    dk,
    dv,
    k,
    v,
    k_pos,
    q_base,
    a_base,
    stats_base,
    LSE2,
    DS_SCALE,
    DPC,
    GQ2,
    stride_qt,
    stride_at,
    lo,
    hi,
    Tq,
    Tk,
    offset,
    window,
    doc_base,
    offs_m,
    b,
    h,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Accumulate dk, dv of one key tile (BLOCK_N rows) over query tiles [lo, hi) of query head h.

    Tiles are computed transposed (keys x queries) so dk and dv come out of plain dots. With TMA q_base and
    a_base are descriptors of the whole q and g_acc (the copy engine moves the tiles; rows past Tq read as 0),
    else pointers to batch b's head h.
    """
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q = _rows_of_head(q_base, b, h, start_m, stride_qt, Tq, BLOCK_M, HEAD_DIM, MASKED, TMA)
        g_acc = _rows_of_head(a_base, b, h, start_m, stride_at, Tq, BLOCK_M, HEAD_DIM, MASKED, TMA)
        if MASKED:
            row_ok = rows < Tq
            lse2 = tl.load(LSE2 + stats_base + rows, mask=row_ok, other=0.0)
            ds_scale = tl.load(DS_SCALE + stats_base + rows, mask=row_ok, other=0.0)
            dp_const = tl.load(DPC + stats_base + rows, mask=row_ok, other=0.0)
            g_q2 = tl.load(GQ2 + stats_base + rows, mask=row_ok, other=0.0)
        else:
            lse2 = tl.load(LSE2 + stats_base + rows)
            ds_scale = tl.load(DS_SCALE + stats_base + rows)
            dp_const = tl.load(DPC + stats_base + rows)
            g_q2 = tl.load(GQ2 + stats_base + rows)
        a_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * (ds_scale * LOG2E)[None, :] - lse2[None, :]
        if MASKED:
            q_pos = offset + rows
            if DOCUMENTS:
                row_first = _row_doc_starts(doc_base, q_pos, Tk)
            else:
                row_first = q_pos  # unread
            vis = _document_visibility(q_pos[None, :], k_pos[:, None], window, row_first[None, :], DOCUMENTS)
            vis = vis & (rows < Tq)[None, :]
            a_t = tl.where(vis, a_t, float("-inf"))
        p_t = tl.math.exp2(a_t)
        dv = tl.dot(p_t.to(g_acc.dtype), g_acc, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(g_acc), input_precision=DOT_PRECISION)
        # ds = p (dp + dp_const + 2 g_q2 p) ds_scale, with the per-query factors folded: two FMAs and a product
        dp_w = (dp_const * ds_scale)[None, :]
        p_w = (2.0 * g_q2 * ds_scale)[None, :]
        ds_t = p_t * (dp_t * ds_scale[None, :] + dp_w + p_w * p_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@resources.autotune(DKDV_CONFIGS, key=TUNING_KEY, single=not AUTOTUNE)
@triton.jit
def polar_bwd_dkdv_kernel(
    Q,
    K,
    V,
    GACC,
    LSE2,
    DS_SCALE,
    DPC,
    GQ2,
    DOC_START,
    DOC_END,
    DK,
    DV,
    Q_DESC,
    GACC_DESC,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    Tq,
    Tk,
    H,
    window,
    TQ_BUCKET,  # autotuning key only: lengths rounded up to a power of two
    TK_BUCKET,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
):
    """Q_DESC, GACC_DESC: with TMA (Hopper) the descriptors of Q and GACC, else unread stand-ins."""
    start_n = tl.program_id(0) * BLOCK_N
    b, kvh = _batch_and_head(tl.program_id(1), H // GROUP)
    offset = Tk - Tq

    k_pos = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # k, dk share K's layout and v, dv share V's
    k_off = b * stride_kb + kvh * stride_kh
    v_off = b * stride_vb + kvh * stride_vh
    k = _load_tile(_tile(K + k_off, Tk, start_n, stride_kt, BLOCK_N, HEAD_DIM), True)
    v = _load_tile(_tile(V + v_off, Tk, start_n, stride_vt, BLOCK_N, HEAD_DIM), True)

    doc_base = DOC_START + b * Tk
    lo, full_lo, full_hi, hi = _query_sweep(DOC_END + b * Tk, start_n, Tq, Tk, window, BLOCK_M, BLOCK_N, DOCUMENTS)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(GROUP):
        h = kvh * GROUP + g
        if TMA:
            q_base = Q_DESC
            a_base = GACC_DESC
        else:
            q_base = Q + b * stride_qb + h * stride_qh
            a_base = GACC + b * stride_qb + h * stride_qh  # g_acc has q's layout
        stats_base = (b * H + h) * Tq
        args = (k, v, k_pos, q_base, a_base, stats_base, LSE2, DS_SCALE, DPC, GQ2, stride_qt, stride_qt)
        if SPLIT_MASK:
            dk, dv = _dkdv_query_tiles(
                dk, dv, *args, lo, tl.minimum(full_lo, hi), Tq, Tk, offset, window, doc_base, offs_m, b, h, HEAD_DIM,
                True, BLOCK_M, DOT_PRECISION, DOCUMENTS, TMA,
            )  # fmt: skip
            dk, dv = _dkdv_query_tiles(
                dk, dv, *args, full_lo, full_hi, Tq, Tk, offset, window, doc_base, offs_m, b, h, HEAD_DIM,
                False, BLOCK_M, DOT_PRECISION, DOCUMENTS, TMA,
            )  # fmt: skip
            dk, dv = _dkdv_query_tiles(
                dk, dv, *args, tl.maximum(full_lo, full_hi), hi, Tq, Tk, offset, window, doc_base, offs_m,
                b, h, HEAD_DIM, True, BLOCK_M, DOT_PRECISION, DOCUMENTS, TMA,
            )  # fmt: skip
        else:
            dk, dv = _dkdv_query_tiles(
                dk, dv, *args, lo, hi, Tq, Tk, offset, window, doc_base, offs_m, b, h, HEAD_DIM, True,
                BLOCK_M, DOT_PRECISION, DOCUMENTS, TMA,
            )  # fmt: skip
    _store_tile(_tile(DK + k_off, Tk, start_n, stride_kt, BLOCK_N, HEAD_DIM), dk)
    _store_tile(_tile(DV + v_off, Tk, start_n, stride_vt, BLOCK_N, HEAD_DIM), dv)


# ----------------------------------------------------------------------------------------------
# Host-side launchers (plain tensors in, plain tensors out; autograd lives in ops.py)
# ----------------------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision dots rather than TF32 (half types ignore this)
    return "ieee" if dtype == torch.float32 else "tf32"


class HeadParams:
    """Per-head parameters transformed for the kernels (fp32, contiguous)."""

    def __init__(self, len_gain, null_base, null_slope, mag_beta, v_null):
        f = torch.nn.functional.softplus
        self.len_gain = len_gain.float()
        self.null_slope = null_slope.float()
        self.mag_beta = mag_beta.float()
        self.sp_alpha = f(self.len_gain).contiguous()
        self.null_base = null_base.float().contiguous()
        self.sp_gamma = f(self.null_slope).contiguous()
        self.sp_beta = f(self.mag_beta).contiguous()
        self.v_null = v_null.float().contiguous()


def _documents(doc_start, placeholder: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(doc_start as a contiguous int32 (B, Tk), True), or (`placeholder`, False) where there are no documents:
    the kernels then compile without reading it."""
    if doc_start is None:
        return placeholder, False
    return doc_start.to(torch.int32).contiguous(), True


def polar_forward(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window: int, doc_start=None):
    """Returns c (B, Tq, H, D), mag (B, Tq, H) in q's dtype and fp32 (B, H, Tq) lse, n_eff, ||s_vec||.

    doc_start: None or integer (B, Tk) (kernels/documents.py)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    params = HeadParams(len_gain, null_base, null_slope, mag_beta, v_null)
    doc_start, documents = _documents(doc_start, q)
    c = torch.empty_like(q)
    mag = q.new_empty(b, tq, h)
    lse, n_eff, s_norm = (q.new_empty(b, h, tq, dtype=torch.float32) for _ in range(3))

    def grid(meta):
        return (triton.cdiv(tq, meta["BLOCK_M"]), b * h)

    tma = copy_engine(q.device)
    polar_fwd_kernel[grid](
        q, k, v, c, mag, lse, n_eff, s_norm,
        params.sp_alpha, params.null_base, params.sp_gamma, params.sp_beta, params.v_null, doc_start,
        *(_descriptor(x) if tma else x for x in (k, v)),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        mag.stride(0), mag.stride(1), mag.stride(2),
        tq, tk, h, window, 1.0 / math.sqrt(d), *length_buckets(tq, tk),
        GROUP=h // hkv, HEAD_DIM=d, DOT_PRECISION=_dot_precision(q.dtype), DOCUMENTS=documents, TMA=tma,
    )  # fmt: skip
    return c, mag, lse, n_eff, s_norm


def length_buckets(tq: int, tk: int) -> tuple[int, int]:
    """Autotuning keys: Tq and Tk rounded up to powers of two, so an evaluation over many lengths
    tunes once per octave instead of once per length."""
    return triton.next_power_of_2(tq), triton.next_power_of_2(tk)


def _preamble(q, g_c, g_mag, c, lse, n_eff, s_norm, params: HeadParams, tk: int, window: int, doc_start, documents):
    """Launch the per-query backward preamble; returns its per-query outputs."""
    b, tq, h, d = q.shape
    g_acc = torch.empty_like(q)
    stats = [q.new_empty(b, h, tq, dtype=torch.float32) for _ in range(8)]
    lse2, ds_scale, dp_const, g_q2, da_null, delta_rest, keep, dmag_row = stats
    n_tiles = triton.cdiv(tq, PREAMBLE_BLOCK_M)
    dvnull_part = q.new_empty(b, h, n_tiles, d, dtype=torch.float32)
    polar_bwd_preamble_kernel[(n_tiles, b * h)](
        c, g_c, g_mag, lse, n_eff, s_norm,
        params.sp_alpha, params.null_base, params.sp_gamma, params.sp_beta, params.v_null, doc_start,
        g_acc, lse2, ds_scale, dp_const, g_q2, da_null, delta_rest, keep, dmag_row, dvnull_part,
        c.stride(0), c.stride(1), c.stride(2),
        g_c.stride(0), g_c.stride(1), g_c.stride(2),
        g_mag.stride(0), g_mag.stride(1), g_mag.stride(2),
        g_acc.stride(0), g_acc.stride(1), g_acc.stride(2),
        tq, tk, h, window, 1.0 / math.sqrt(d),
        HEAD_DIM=d, DOCUMENTS=documents, BLOCK_M=PREAMBLE_BLOCK_M,
        num_warps=PREAMBLE_WARPS,
    )  # fmt: skip
    return g_acc, lse2, ds_scale, dp_const, g_q2, da_null, delta_rest, keep, dmag_row, dvnull_part


def _head_gradients(params: HeadParams, da_s, da_null, dmag_row, dvnull_part, tq, tk, window, doc_start=None):
    """Per-head parameter gradients from per-query fp32 (B, H, Tq) quantities.

    a_j = temp s_j and a_N = temp null, so d temp = sum_j da_j s_j + da_N null and d null = da_N temp.
    With doc_start each (batch, query) has its own count n.
    """
    n = visible_key_counts(tq, tk, window, da_s.device, doc_start).float()  # (Tq,), or (B, Tq)
    if doc_start is not None:
        n = n[:, None, :]
    log_n, root = torch.log(n), torch.sqrt(torch.log1p(n))
    temp = 1.0 + params.sp_alpha[:, None] * log_n  # (H, Tq), or (B, H, Tq)
    null = params.null_base[:, None] + params.sp_gamma[:, None] * root
    d_temp = da_s + da_null * null
    d_null = da_null * temp
    d_len_gain = (d_temp * log_n).sum(dim=(0, 2)) * torch.sigmoid(params.len_gain)
    d_null_base = d_null.sum(dim=(0, 2))
    d_null_slope = (d_null * root).sum(dim=(0, 2)) * torch.sigmoid(params.null_slope)
    d_mag_beta = dmag_row.sum(dim=(0, 2)) * torch.sigmoid(params.mag_beta)
    d_v_null = dvnull_part.sum(dim=(0, 2))
    return d_len_gain, d_null_base, d_null_slope, d_mag_beta, d_v_null


def copy_engine(device: torch.device) -> bool:
    """Whether the kernels take the tiles they loop over through Hopper's copy engine (the tensor memory
    accelerator, by Triton's tensor descriptors): on compute capability 9 and up, never under the interpreter,
    and not with ATMA_TRITON_COPY_ENGINE=0 (backends.COPY_ENGINE)."""
    if not COPY_ENGINE or device.type != "cuda" or INTERPRET:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _descriptor(x: torch.Tensor) -> TensorDescriptor:
    """A (B, T, H, D) tensor's descriptor for the copy engine; its block shape is the config's
    (_descriptor_blocks)."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 16, 1, x.shape[-1]])


def polar_backward(
    g_c, g_mag, q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, c, lse, n_eff, s_norm, window: int,
    doc_start=None,
):  # fmt: skip
    """All eight input gradients (fp32 for the per-head parameters, input dtype for q, k, v)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    params = HeadParams(len_gain, null_base, null_slope, mag_beta, v_null)
    doc_start, documents = _documents(doc_start, q)
    # each key's exclusive document end bounds the dk/dv kernel's query loop
    doc_end = document_ends(doc_start).contiguous() if documents else q
    g_acc, lse2, ds_scale, dp_const, g_q2, da_null_pre, delta_rest, keep, dmag_row, dvnull_part = _preamble(
        q, g_c, g_mag, c, lse, n_eff, s_norm, params, tk, window, doc_start, documents
    )
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    da_s, da_null = (q.new_empty(b, h, tq, dtype=torch.float32) for _ in range(2))
    scale = 1.0 / math.sqrt(d)
    tma = copy_engine(q.device)
    common = dict(GROUP=h // hkv, HEAD_DIM=d, DOT_PRECISION=_dot_precision(q.dtype), DOCUMENTS=documents, TMA=tma)
    buckets = length_buckets(tq, tk)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    strides += (v.stride(0), v.stride(1), v.stride(2))
    # on Hopper the tiles each kernel loops over come through descriptors (else the tensors stand in, unread)
    k_desc, v_desc, q_desc, a_desc = (_descriptor(x) if tma else x for x in (k, v, q, g_acc))

    def dq_grid(meta):
        return (triton.cdiv(tq, meta["BLOCK_M"]), b * h)

    # da_null is a separate output (not updated in place): autotuning reruns the kernel
    polar_bwd_dq_kernel[dq_grid](
        q, k, v, g_acc, lse2, dp_const, g_q2, delta_rest, keep, da_null_pre, params.sp_alpha, doc_start,
        dq, da_s, da_null, k_desc, v_desc, *strides, tq, tk, h, window, scale, *buckets, **common,
    )  # fmt: skip

    def dkdv_grid(meta):
        return (triton.cdiv(tk, meta["BLOCK_N"]), b * hkv)

    polar_bwd_dkdv_kernel[dkdv_grid](
        q, k, v, g_acc, lse2, ds_scale, dp_const, g_q2, doc_start, doc_end, dk, dv, q_desc, a_desc,
        *strides, tq, tk, h, window, *buckets, **common,
    )  # fmt: skip
    head_grads = _head_gradients(
        params, da_s, da_null, dmag_row, dvnull_part, tq, tk, window, doc_start if documents else None
    )
    return (dq, dk, dv, *head_grads)
