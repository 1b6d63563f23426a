"""Paged Polar decode in Triton: one split-KV kernel that also merges, split policy and launcher.

One query per sequence (decode) over a paged KV cache (kernels/paged.py); the math is the streaming
reference's (`reference.py`), cut along the keys. One launch, one program per (KV head, split, sequence):

- **Partial**: the G = H / Hkv query heads of one KV group are one (G_PAD x D) query tile (G padded to
  16 for tl.dot), so each K/V tile is read once per group. A split is a contiguous range of
  `pages_per_split` block-table entries; key tiles of BLOCK_N rows are read through the block table (a
  tile may span several pages, or a page hold several tiles). The program writes per (b, h, split) the
  base-2 running max m, l = sum 2^(a2 - m), q2 = sum 2^(2 (a2 - m)) and acc = sum 2^(a2 - m) v (fp32)
  to a workspace. A program whose range holds no visible key (past the context, or wholly before the
  window) loops zero times and writes m = -inf, l = q2 = 0, acc = 0.
- **Merge, by the last program to finish**: the splits of a group are cut into buckets of MERGE_BUCKET;
  each program then counts its arrival on its bucket's atomic counter, and the last to arrive folds the
  bucket's partials (M = max_s m_s, w_s = 2^(m_s - M), l = sum w_s l_s, q2 = sum w_s^2 q2_s,
  acc = sum w_s acc_s). With one bucket it then does the readout; with several it stores the bucket's
  fold and counts on the group's counter, and the last bucket to arrive folds the buckets and does the
  readout (null folded in through keep = sigmoid(lse - a_N), c = s_vec / max(||s_vec||, 1e-6), mag from
  n_eff = l^2 / q2). Two levels keep each fold short (1 x 64K has ~256 splits per group). The counters
  live in a per-device int32 buffer that every launch leaves at 0 (the last arrival resets each), so no
  launch has to clear it and a CUDA-graph replay finds it as the capture did.

Conventions as in triton_attention.py: logits in base 2 (a2 = q.k * temp * scale * log2(e)), everything
reduced in fp32, tl.dot operands in the input dtype (fp32: IEEE products, not TF32). The raw per-head
parameters are read directly and softplus is applied in the kernel (no extra launches per step).

The split policy (`decode_split`) and the tile config depend on shapes and the device only, never on
context_lens values: a launch does no host sync and allocates only shape-sized workspaces, so it can be
captured in a CUDA graph and replayed with new context_lens / block_table contents.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from atma_titan.kernels import resources
from atma_titan.kernels.backends import INTERPRET
from atma_titan.kernels.polar.triton_math import log1p, sigmoid, softplus, tanh_nonneg

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
NORM_EPS = tl.constexpr(1e-6)

# ----------------------------------------------------------------------------------------------
# Configuration: tile, warps and stages; how many programs the split policy aims for
# ----------------------------------------------------------------------------------------------

# (BLOCK_N, num_warps, num_stages) in order of preference; the first whose compiled shared memory fits the
# device's opt-in limit per block runs (checked at the first launch of each shape, see _fitting_tile; sm_89
# has 99 KiB per block, sm_80 163 KiB, sm_90 227 KiB). For sm_90 (Triton 3.6)
# the kernel with 64-row bf16 tiles takes ~39 KB of shared memory and 108 registers (pages < tile) or 112
# (pages >= tile), the merge's fold included; 128-row tiles and 3 stages were no faster once the split count
# fills one wave (docs/kernels.md). benchmarks/kernels/kernel_resources.py compiles both for sm_80 / 89 / 90.
CUDA_CONFIGS = [(64, 4, 2), (32, 4, 2)]
# the interpreter: 32-row tiles, so the tests' pages of 16 are smaller than a tile and pages of 64 larger
INTERPRET_CONFIG = (32, 1, 1)
# split-KV: at most one wave of partial programs, PROGRAMS_PER_SM resident per SM (registers limit the
# 64-row tile to 4 x 4 warps per SM with pages of 16); each split gets at least MIN_SPLIT_KEYS keys
PROGRAMS_PER_SM = 4
MIN_SPLIT_KEYS = 256
# merge: splits per first-level bucket (1 x 64K has 256 splits per group: 16 buckets of 16), and the fp32
# elements of one fold step's acc tile (GP heads x splits x D). The folds of the last bucket and of the
# buckets are on the critical path, one dependent L2 round trip per step: 4096 (8 splits at G 4, D 128) was
# ~1 us faster at 1 x 64K than 2048 and stays within 128 registers (4 programs per SM). Launches of at least
# LONG_MERGE_SPLITS splits, where the merge is a large part of a short launch, fold a whole bucket per step
# (LONG_MERGE_TILE_ELEMS) with registers capped at LONG_MERGE_REGISTERS so 4 programs still fit an SM (the
# cold fold spills a little): +2-4% at 1 x 64K; 1-2% slower at batch >= 32 (docs/kernels.md section 2.5)
MERGE_BUCKET = 16
MERGE_TILE_ELEMS = 4096
LONG_MERGE_SPLITS = 64
LONG_MERGE_TILE_ELEMS = 8192
LONG_MERGE_REGISTERS = 128
# load the next tile's page ids one tile ahead, off the K/V loads' critical path: off, since with 4096-element
# folds it takes the kernel past 128 registers (142 with pages of 16) and 3 programs per SM (A/B in the JSON)
PREFETCH_PAGES = False


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`; a nominal 8 on the CPU (the interpreter)."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def tile_config(device: torch.device, head_dim: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) preferred on `device`: the interpreter's, else the first of
    CUDA_CONFIGS (the launch falls back to a later one where its compiled shared memory does not fit)."""
    if device.type != "cuda" or INTERPRET:
        return INTERPRET_CONFIG
    return CUDA_CONFIGS[0]


def decode_split(
    batch: int,
    kv_heads: int,
    max_blocks: int,
    page_size: int,
    n_sms: int,
    *,
    block_n: int = 64,
    programs_per_sm: int = PROGRAMS_PER_SM,
    min_split_keys: int = MIN_SPLIT_KEYS,
    num_splits: int | None = None,
) -> tuple[int, int]:
    """(num_splits, pages_per_split) of the split-KV launch, from shapes only (CUDA-graph safe).

    Without an override: as many splits as fit batch * kv_heads * num_splits into one wave of
    programs_per_sm * n_sms resident programs (a second, partial wave of equally long programs would
    leave the GPU mostly idle while it runs), at least one, and no split shorter than min_split_keys keys
    of the block table's capacity. Large batches (batch * kv_heads beyond one wave) take one split. A split is a whole
    number of pages, and of BLOCK_N tiles where pages are smaller than a tile; num_splits is then
    recomputed so no split is wholly past the table. `num_splits` forces the count (tests); it is still
    limited to one split per page (per tile for small pages), so more splits than needed just leave
    programs with no keys.
    """
    capacity = max_blocks * page_size
    if num_splits is None:
        want = int(programs_per_sm * n_sms // max(batch * kv_heads, 1))
        num_splits = max(1, min(want, capacity // min_split_keys))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    pages_per_split = -(-max_blocks // num_splits)
    align = max(1, block_n // page_size)  # pages per tile
    pages_per_split = -(-pages_per_split // align) * align
    return -(-max_blocks // pages_per_split), pages_per_split


# ----------------------------------------------------------------------------------------------
# Small scalar helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _visible_count(n_ctx, window):
    """n = min(context_len, window) (window 0: no window), fp32."""
    return tl.where(window > 0, tl.minimum(n_ctx, window), n_ctx).to(tl.float32)


# ----------------------------------------------------------------------------------------------
# Split-KV part: one (KV group, split, sequence) over its key tiles
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_pages(table, tile_lo, split_hi, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids of the key tile at tile_lo: one scalar where pages >= the tile (splits are whole pages and
    tiles are aligned inside them), else one per row; entries at or past split_hi read as page 0 (masked)."""
    if PAGE_SIZE >= BLOCK_N:
        return tl.load(table + tile_lo // PAGE_SIZE, mask=tile_lo < split_hi, other=0)
    else:
        # the tile's BLOCK_N / PAGE_SIZE entries in one vector load, each repeated for its page's rows
        # (~0.5-1% faster than one load per row at every shape with pages of 16)
        NP: tl.constexpr = BLOCK_N // PAGE_SIZE
        entry = tile_lo // PAGE_SIZE + tl.arange(0, NP)
        ids = tl.load(table + entry, mask=entry * PAGE_SIZE < split_hi, other=0)
        return tl.reshape(tl.broadcast_to(ids[:, None], (NP, PAGE_SIZE)), (BLOCK_N,))


@triton.jit
def _partial_tile(
    m,
    l,
    q2,
    acc,
    page,
    tile_lo,
    q,
    row_scale,
    k_base,
    v_base,
    offs_d,
    table,
    stride_kp,
    stride_kt,
    stride_vp,
    stride_vt,
    lo,
    split_hi,
    offs_n,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OFFS_64: tl.constexpr,
    PREFETCH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile [tile_lo, tile_lo + BLOCK_N) read through the block table; visible keys are [lo, split_hi).

    `page` holds the tile's page ids when PREFETCH (loaded one tile ahead, so the table read is off the
    K/V loads' critical path); the next tile's are returned. OFFS_64: 64-bit offsets (caches of 2^31 or
    more elements), else 32-bit."""
    if PREFETCH:
        page_next = _tile_pages(table, tile_lo + BLOCK_N, split_hi, PAGE_SIZE, BLOCK_N)
    else:
        page = _tile_pages(table, tile_lo, split_hi, PAGE_SIZE, BLOCK_N)
        page_next = page
    if OFFS_64:
        page = page.to(tl.int64)
    pos = tile_lo + offs_n
    vis = (pos >= lo) & (pos < split_hi)
    slot = pos % PAGE_SIZE
    if PAGE_SIZE >= BLOCK_N:
        # one page per tile: one page pointer and offsets inside the page (fewer registers than per-row offsets)
        k_ptrs = (k_base + page * stride_kp) + ((slot * stride_kt)[:, None] + offs_d[None, :])
        v_ptrs = (v_base + page * stride_vp) + ((slot * stride_vt)[:, None] + offs_d[None, :])
    else:
        k_ptrs = k_base + ((page * stride_kp + slot * stride_kt)[:, None] + offs_d[None, :])
        v_ptrs = v_base + ((page * stride_vp + slot * stride_vt)[:, None] + offs_d[None, :])
    k = tl.load(k_ptrs, mask=vis[:, None], other=0.0)
    v = tl.load(v_ptrs, mask=vis[:, None], other=0.0)
    a = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * row_scale[:, None]
    a = tl.where(vis[None, :], a, float("-inf"))
    m_new = tl.maximum(m, tl.max(a, 1))
    rescale = tl.math.exp2(m - m_new)
    p = tl.math.exp2(a - m_new[:, None])
    l = l * rescale + tl.sum(p, 1)
    q2 = q2 * (rescale * rescale) + tl.sum(p * p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None], input_precision=DOT_PRECISION)
    return m_new, l, q2, acc, page_next


# ----------------------------------------------------------------------------------------------
# Merge part: folding stored partials, and the readout of reference._Readout
# ----------------------------------------------------------------------------------------------


@triton.jit
def _merge_range(
    M_WS, L_WS, Q2_WS, ACC_WS, rows, g_ok, s_lo, s_hi, offs_d,
    GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """(M, l, q2, acc) of the GP heads at workspace rows `rows` folded over slots [s_lo, s_hi):
    M = max_s m_s, w_s = 2^(m_s - M), l = sum w_s l_s, q2 = sum w_s^2 q2_s, acc = sum w_s acc_s.
    The slots were written by other programs of this launch: loads go to L2 (.cg), never a stale L1."""
    big_m = tl.full([GP], -1.0e30, tl.float32)  # finite: empty slots (m = -inf) get weight 0 without NaNs
    l = tl.zeros([GP], tl.float32)
    q2 = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HEAD_DIM], tl.float32)
    s0 = s_lo
    while s0 < s_hi:  # few iterations (one per BLOCK_S slots); a while loop also runs under the interpreter
        offs_s = s0 + tl.arange(0, BLOCK_S)
        ok = g_ok[:, None] & (offs_s < s_hi)[None, :]
        idx = rows[:, None] + offs_s[None, :]
        m_s = tl.load(M_WS + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(L_WS + idx, mask=ok, other=0.0, cache_modifier=".cg")
        q2_s = tl.load(Q2_WS + idx, mask=ok, other=0.0, cache_modifier=".cg")
        acc_ptrs = ACC_WS + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :]
        acc_s = tl.load(acc_ptrs, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(big_m, tl.max(m_s, 1))
        r = tl.math.exp2(big_m - m_new)
        w = tl.math.exp2(m_s - m_new[:, None])
        l = l * r + tl.sum(w * l_s, 1)
        q2 = q2 * (r * r) + tl.sum(w * w * q2_s, 1)
        acc = acc * r[:, None] + tl.sum(w[:, :, None] * acc_s, 1)
        big_m = m_new
        s0 += BLOCK_S
    return big_m, l, q2, acc


@triton.jit
def _store_slot(M_WS, L_WS, Q2_WS, ACC_WS, rows, g_ok, slot, big_m, l, q2, acc, offs_d, HEAD_DIM: tl.constexpr):
    """Write (m, l, q2, acc) of the GP heads at workspace slot `slot`; m = -inf where no key was seen."""
    row = rows + slot
    tl.store(M_WS + row, tl.where(l > 0, big_m, float("-inf")), mask=g_ok)
    tl.store(L_WS + row, l, mask=g_ok)
    tl.store(Q2_WS + row, q2, mask=g_ok)
    tl.store(ACC_WS + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _readout(
    big_m, l, q2, acc, n, heads, g_ok, offs_d, c_ptrs, mag_ptrs, LEN_GAIN, NULL_BASE, NULL_SLOPE, MAG_BETA, V_NULL,
    stride_vn,
):  # fmt: skip
    """c and mag of the GP heads `heads` from their merged (M, l, q2, acc) over n visible keys."""
    temp = 1.0 + softplus(tl.load(LEN_GAIN + heads, mask=g_ok, other=0.0).to(tl.float32)) * tl.log(n)
    null_base = tl.load(NULL_BASE + heads, mask=g_ok, other=0.0).to(tl.float32)
    null_slope = softplus(tl.load(NULL_SLOPE + heads, mask=g_ok, other=0.0).to(tl.float32))
    null_logit = temp * (null_base + null_slope * tl.sqrt(tl.log(1.0 + n)))
    l = tl.where(l > 0, l, 1.0)  # only if every key were masked (context_lens >= 1 rules it out)
    q2 = tl.where(q2 > 0, q2, 1.0)
    lse = (big_m + tl.math.log2(l)) * LN2  # natural log of sum_j e^(a_j)
    keep = sigmoid(lse - null_logit)
    w_null = sigmoid(null_logit - lse)
    v_null = tl.load(V_NULL + heads[:, None] * stride_vn + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    s_vec = acc * (keep / l)[:, None] + w_null[:, None] * v_null.to(tl.float32)
    s_norm = tl.sqrt(tl.sum(s_vec * s_vec, 1))
    c = s_vec / tl.maximum(s_norm, NORM_EPS)[:, None]
    beta = softplus(tl.load(MAG_BETA + heads, mask=g_ok, other=0.0).to(tl.float32))
    mag = tanh_nonneg(beta * log1p(l * l / q2 * keep))
    tl.store(c_ptrs, c.to(c_ptrs.dtype.element_ty), mask=g_ok[:, None])
    tl.store(mag_ptrs, mag.to(mag_ptrs.dtype.element_ty), mask=g_ok)


# ----------------------------------------------------------------------------------------------
# The kernel: split-KV partial, then the last program of a bucket / group merges
# ----------------------------------------------------------------------------------------------


@triton.jit
def polar_decode_kernel(
    Q,
    K,
    V,
    BLOCK_TABLE,
    CONTEXT_LENS,
    LEN_GAIN,
    NULL_BASE,
    NULL_SLOPE,
    MAG_BETA,
    V_NULL,
    M_WS,
    L_WS,
    Q2_WS,
    ACC_WS,
    COUNTERS,
    C,
    MAG,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_cb,
    stride_ch,
    stride_vn,
    H,
    HKV,
    num_splits,
    num_buckets,
    split_keys,
    window,
    sm_scale,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    GP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BUCKET: tl.constexpr,
    MERGE_BLOCK_S: tl.constexpr,
    OFFS_64: tl.constexpr,
    PREFETCH: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    # KV head fastest: the programs reading the Hkv interleaved halves of the same pages run together
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    n_ctx = tl.load(CONTEXT_LENS + b).to(tl.int32)
    split_lo = split * split_keys
    split_hi = tl.minimum(split_lo + split_keys, n_ctx)
    first_key = tl.where(window > 0, tl.maximum(n_ctx - window, 0), 0)
    lo = tl.maximum(split_lo, first_key)  # first visible key of the split
    start = split_lo + ((lo - split_lo) // BLOCK_N) * BLOCK_N  # tile-aligned within the split
    stop = tl.where(lo < split_hi, split_hi, start)  # no visible key: zero iterations

    offs_g = tl.arange(0, G_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    sp_alpha = softplus(tl.load(LEN_GAIN + heads, mask=g_ok, other=0.0).to(tl.float32))
    row_scale = (1.0 + sp_alpha * tl.log(_visible_count(n_ctx, window))) * (sm_scale * LOG2E)

    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    table = BLOCK_TABLE + b * stride_bt
    # finite start for m: a tile with no visible key keeps rescale = 1 and p = 0
    m = tl.full([G_PAD], -1.0e30, tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    q2 = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    args = (
        q,
        row_scale,
        k_base,
        v_base,
        offs_d,
        table,
        stride_kp,
        stride_kt,
        stride_vp,
        stride_vt,
        lo,
        split_hi,
        offs_n,
    )
    page = _tile_pages(table, start, split_hi, PAGE_SIZE, BLOCK_N)  # the first tile's (PREFETCH)
    if INTERPRETED:
        # Triton 3.6's interpreter keeps scalar loads as 1-element arrays, which range() rejects
        tile_lo = start
        while tile_lo < stop:
            m, l, q2, acc, page = _partial_tile(
                m, l, q2, acc, page, tile_lo, *args, PAGE_SIZE, BLOCK_N, OFFS_64, PREFETCH, DOT_PRECISION
            )
            tile_lo += BLOCK_N
    else:
        for tile_lo in range(start, stop, BLOCK_N):
            m, l, q2, acc, page = _partial_tile(
                m, l, q2, acc, page, tile_lo, *args, PAGE_SIZE, BLOCK_N, OFFS_64, PREFETCH, DOT_PRECISION
            )

    # Workspace slots per (b, h): num_splits partials, then (with several buckets) one per bucket
    slots = num_splits + tl.where(num_buckets > 1, num_buckets, 0)
    rows = (b * H + heads) * slots
    m = tl.where(l > 0, m, float("-inf"))
    tl.store(M_WS + rows + split, m, mask=g_ok)
    tl.store(L_WS + rows + split, l, mask=g_ok)
    tl.store(Q2_WS + rows + split, q2, mask=g_ok)
    tl.store(ACC_WS + (rows + split)[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])

    # The last program of each bucket of BUCKET splits to finish merges the bucket; with several buckets
    # the last bucket merger of the group merges the buckets. Counters: per (b, kv head) one for the group,
    # then one per bucket; each is reset to 0 by the program that saw the last arrival, so the next launch
    # (or CUDA-graph replay) finds them at 0. The barrier orders every thread's stores before the release
    # of the atomic (acq_rel, GPU scope), whose acquire orders the merge loads after the other programs'.
    offs_gp = tl.arange(0, GP)
    gp_ok = offs_gp < GROUP
    m_heads = kvh * GROUP + offs_gp
    m_rows = (b * H + m_heads) * slots
    counter = COUNTERS + (b * HKV + kvh) * (num_buckets + 1)
    bucket = split // BUCKET
    s_lo = bucket * BUCKET
    s_hi = tl.minimum(s_lo + BUCKET, num_splits)
    tl.debug_barrier()
    last = tl.atomic_add(counter + 1 + bucket, 1, sem="acq_rel", scope="gpu") == s_hi - s_lo - 1
    if last:
        tl.store(counter + 1 + bucket, 0)
        f_m, f_l, f_q2, f_acc = _merge_range(
            M_WS, L_WS, Q2_WS, ACC_WS, m_rows, gp_ok, s_lo, s_hi, offs_d, GP, HEAD_DIM, MERGE_BLOCK_S, INTERPRETED
        )
        if num_buckets > 1:
            _store_slot(
                M_WS, L_WS, Q2_WS, ACC_WS, m_rows, gp_ok, num_splits + bucket, f_m, f_l, f_q2, f_acc, offs_d, HEAD_DIM
            )
            tl.debug_barrier()
            last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_buckets - 1
            if last:
                tl.store(counter, 0)
                f_m, f_l, f_q2, f_acc = _merge_range(
                    M_WS, L_WS, Q2_WS, ACC_WS, m_rows, gp_ok, num_splits, num_splits + num_buckets, offs_d,
                    GP, HEAD_DIM, MERGE_BLOCK_S, INTERPRETED,
                )  # fmt: skip
        if last:
            c_ptrs = C + b * stride_cb + m_heads[:, None] * stride_ch + offs_d[None, :]
            n = _visible_count(n_ctx, window)
            _readout(
                f_m, f_l, f_q2, f_acc, n, m_heads, gp_ok, offs_d, c_ptrs, MAG + b * H + m_heads,
                LEN_GAIN, NULL_BASE, NULL_SLOPE, MAG_BETA, V_NULL, stride_vn,
            )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

# Per device: the arrival counters, all 0 between launches (each launch leaves them as it found them).
# Buffers are only ever added, never freed, since a captured CUDA graph may hold a pointer to any of them.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _counters(device: torch.device, size: int) -> torch.Tensor:
    """An int32 buffer of at least `size` zeros on `device` for the launch's arrival counters.

    Launches on one device share it, so they must not run concurrently (one stream, as a decode step
    does). Inside a CUDA-graph capture a buffer is never added to the cache: one that is too small is
    replaced by a zeroed tensor of the capture (its memset is captured and replayed)."""
    bufs = _COUNTERS.setdefault(device, [])
    if bufs and bufs[-1].numel() >= size:
        return bufs[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(size, dtype=torch.int32, device=device)
    bufs.append(torch.zeros(max(size, 4096), dtype=torch.int32, device=device))
    return bufs[-1]


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def polar_decode_forward(
    q,
    k_pages,
    v_pages,
    block_table,
    context_lens,
    len_gain,
    null_base,
    null_slope,
    mag_beta,
    v_null,
    window: int,
    num_splits: int | None = None,
    config: tuple[int, int, int] | None = None,
):
    """c (B, H, D), mag (B, H) in q's dtype. Shapes as in `reference.polar_decode_reference`; q and the
    pages share a dtype, the head dimension and pages have unit stride along D. `num_splits` forces
    the split count and `config` the (BLOCK_N, num_warps, num_stages) tile config (tests, benchmarks)."""
    b, h, d = q.shape
    _, page_size, hkv, _ = k_pages.shape
    group = h // hkv
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_pages = k_pages if k_pages.stride(-1) == 1 else k_pages.contiguous()
    v_pages = v_pages if v_pages.stride(-1) == 1 else v_pages.contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    len_gain, null_base, null_slope, mag_beta = (x.contiguous() for x in (len_gain, null_base, null_slope, mag_beta))
    v_null = v_null if v_null.stride(-1) == 1 else v_null.contiguous()

    def launch(tile: tuple[int, int, int]):
        """(grid, args, kwargs) of the launch with tile config `tile` (workspaces allocated for it)."""
        block_n, num_warps, num_stages = tile
        splits, pages_per_split = decode_split(
            b, hkv, block_table.shape[1], page_size, sm_count(q.device), block_n=block_n, num_splits=num_splits
        )
        buckets = -(-splits // MERGE_BUCKET)
        slots = splits + (buckets if buckets > 1 else 0)
        m, l, q2 = (q.new_empty(b, h, slots, dtype=torch.float32) for _ in range(3))
        acc = q.new_empty(b, h, slots, d, dtype=torch.float32)
        counters = _counters(q.device, b * hkv * (buckets + 1))
        gp = triton.next_power_of_2(group)
        # 64-bit offsets only where a cache holds 2^31 elements or more (a shape-only choice)
        offs_64 = max(k_pages.numel(), v_pages.numel()) >= 2**31
        long_merge = splits >= LONG_MERGE_SPLITS
        tile_elems = LONG_MERGE_TILE_ELEMS if long_merge else MERGE_TILE_ELEMS
        # a compile option of the CUDA backend (the interpreter ignores launch options it does not know)
        register_cap = {"maxnreg": LONG_MERGE_REGISTERS} if long_merge else {}
        args = (
            q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope, mag_beta, v_null,
            m, l, q2, acc, counters, c, mag,
            q.stride(0), q.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
            block_table.stride(0), c.stride(0), c.stride(1), v_null.stride(0),
            h, hkv, splits, buckets, pages_per_split * page_size, window, 1.0 / math.sqrt(d),
        )  # fmt: skip
        kwargs = dict(
            GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), GP=gp, HEAD_DIM=d, PAGE_SIZE=page_size,
            BLOCK_N=block_n, BUCKET=MERGE_BUCKET,
            MERGE_BLOCK_S=min(MERGE_BUCKET, max(1, tile_elems // (gp * d))),
            OFFS_64=offs_64, PREFETCH=PREFETCH_PAGES, DOT_PRECISION=_dot_precision(q.dtype), INTERPRETED=INTERPRET,
            num_warps=num_warps, num_stages=num_stages, **register_cap,
        )  # fmt: skip
        return (hkv, splits, b), args, kwargs

    c = q.new_empty(b, h, d)
    mag = q.new_empty(b, h)
    if config is not None or q.device.type != "cuda" or INTERPRET:
        grid, args, kwargs = launch(config or tile_config(q.device, d, q.element_size()))
    else:
        shape_key = (q.device, q.dtype, k_pages.dtype, b, h, hkv, d, page_size, block_table.shape[1], num_splits)
        grid, args, kwargs = _fitting_tile(shape_key, launch)
    polar_decode_kernel[grid](*args, **kwargs)
    return c, mag


# Per launch shape (device, dtypes and shapes: what the tile choice depends on), the CUDA_CONFIGS entry that fits.
_TILE_CHOICE: dict[tuple, tuple[int, int, int]] = {}


def _fitting_tile(shape_key: tuple, launch):
    """The launch (grid, args, kwargs) of the first CUDA_CONFIGS entry whose compiled shared memory fits the
    device, chosen once per shape: each candidate is compiled (not run) as it would launch, and the compile
    is Triton's own for that launch, so the chosen one is not compiled again."""
    tile = _TILE_CHOICE.get(shape_key)
    if tile is not None:
        return launch(tile)
    device = shape_key[0]
    limit = resources.device_shared_limit(device)
    launches = {}

    def shared_bytes(tile):
        launches[tile] = launch(tile)
        _, args, kwargs = launches[tile]
        return resources.warmup_shared(polar_decode_kernel, args, kwargs)

    try:
        tile = resources.first_fitting(CUDA_CONFIGS, shared_bytes, limit)
    except RuntimeError as err:
        raise RuntimeError(f"polar_decode_kernel: {err}") from None
    _TILE_CHOICE[shape_key] = tile
    return launches[tile]
