"""Plain-PyTorch references for the Polar attention core (docs/model.md section 3), no projections.

For query i with n_i visible keys (causal; with a window W only the last W) and s_ij = q_i.k_j/sqrt(D):

    temp_i = 1 + softplus(len_gain) * ln(n_i)
    null_i = null_base + softplus(null_slope) * sqrt(ln(n_i + 1))
    w_i    = softmax([temp_i s_i1, ..., temp_i s_in, temp_i null_i])        (the null is one more entry)
    s_vec  = sum_j w_ij v_j + w_iN v_null          c_i   = s_vec / max(||s_vec||, 1e-6)
    n_eff  = 1 / sum_j (w_ij / (1 - w_iN))^2       m_eff = n_eff (1 - w_iN)
    mag_i  = tanh(softplus(mag_beta) * ln(1 + m_eff))

Layout (B, T, H, D); k, v have Hkv heads and query head h reads KV head h // (H // Hkv). The Tq
queries are the last Tq of the Tk key positions (query i sits at position p_i = Tk - Tq + i).

Documents (`doc_start`, int32 (B, Tk) indexed by key position; the convention is kernels/documents.py):
query i sees key j only when doc_start[b, p_i] <= j <= p_i (and j > p_i - W with a window), and every
per-query term takes that query's own count n_i = p_i - doc_start[b, p_i] + 1 (at most W): each document
reads as if it ran alone. The streaming form skips the key tiles before a query tile's first document (on CPU,
eager: it reads doc_start on the host), else it masks them.
`doc_start=None` is one document per sequence, by the code paths of before.

`polar_attention_naive` materialises the Tq x Tk weights: ground truth for tests, autograd backward.

`polar_decode_reference` is one decode query per sequence over a paged KV cache (kernels/paged.py):
the naive form's last row, over gathered pages; the ground truth of the paged decode kernel.

`polar_attention_reference` is the streaming form the Triton kernel mirrors. Forward, per query, over key
tiles: running max m of the real-key logits a_j = temp s_j, l = sum e^(a-m), q2 = sum e^(2(a-m)),
acc = sum e^(a-m) v. The null is folded in once at the end through keep = 1 - w_N = l / Z =
sigmoid(m + ln l - a_N), which never forms e^(a_N - m) (that overflows when the null dominates).
Saved per query: m, l, q2, ||s_vec||. Backward: a per-query preamble (g_s, delta = g_s.s_vec, g_me,
g_l, g_q2), then key tiles are recomputed with p_j = e^(a_j - m - ln l), i.e. the p_j of docs/model.md section 3.7
normalised to l = 1 (so Z = 1/keep, q2 = 1/n_eff), and

    dL/dp_j = keep (g_s.v_j - delta) + g_l + 2 g_q2 p_j,    da_j = p_j dL/dp_j,    ds_j = temp da_j.

docs/model.md section 3.7 writes the first term as g_s.v_j: that holds when g_s is taken with respect to
the unnormalised acc + p_N v_null (a 1/Z factor away from s_vec) and ||s_vec|| is not clamped (then
g_s.s_vec = 0).
The form above is exact in both cases.

The per-head scalars take sum_j da_j s_j and da_N with delta recomputed from the sweep's own products
(delta' = sum_j p_j g_acc.v_j + w_N g_s.v_null) rather than from c, which is saved in the input dtype:
see `_consistent_delta_fix`. In exact arithmetic delta' = delta; in bf16 only delta' keeps
sum_j da_j + da_N = 0, without which d len_gain (a small residual) drowns in rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from atma_titan.kernels.documents import check_doc_start
from atma_titan.kernels.paged import gather_pages, key_mask

NORM_EPS = 1e-6

__all__ = [
    "NORM_EPS",
    "polar_attention_naive",
    "polar_attention_reference",
    "polar_decode_reference",
    "polar_scalars",
    "visible_key_counts",
]


# ----------------------------------------------------------------------------------------------
# Shared definitions
# ----------------------------------------------------------------------------------------------


def polar_scalars(
    n: torch.Tensor, len_gain: torch.Tensor, null_base: torch.Tensor, null_slope: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Length temperature and null floor for visible-key counts `n` (plain broadcasting).

    temp = 1 + softplus(len_gain) ln(n),  null = null_base + softplus(null_slope) sqrt(ln(n + 1)).
    E.g. n of shape (T, 1) with per-head parameters of shape (H,) gives (T, H) results.
    """
    if not n.is_floating_point():
        n = n.to(len_gain.dtype)
    temp = 1.0 + F.softplus(len_gain) * torch.log(n)
    null = null_base + F.softplus(null_slope) * torch.sqrt(torch.log1p(n))
    return temp, null


def query_positions(tq: int, tk: int, device: torch.device | None = None) -> torch.Tensor:
    """Absolute positions of the Tq queries: the last Tq of the Tk key positions."""
    return torch.arange(tk - tq, tk, device=device)


def query_doc_starts(tq: int, doc_start: torch.Tensor) -> torch.Tensor:
    """(B, Tq): where each query's document begins (doc_start at the query's key position), as int64."""
    return doc_start[:, doc_start.shape[-1] - tq :].long()


def visible_key_counts(
    tq: int, tk: int, window: int = 0, device: torch.device | None = None, doc_start: torch.Tensor | None = None
) -> torch.Tensor:
    """n_i for each query: pos_i + 1 keys, at most `window` of them when window > 0; shape (Tq,).

    With doc_start (B, Tk): the keys of the query's own document only, pos_i - doc_start[b, pos_i] + 1
    (at most `window`); shape (B, Tq)."""
    n = query_positions(tq, tk, device) + 1
    if doc_start is not None:
        n = n - query_doc_starts(tq, doc_start)
    return n.clamp_max(window) if window > 0 else n


def visibility_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, first: torch.Tensor | None = None
) -> torch.Tensor:
    """(len(q_pos), len(k_pos)) bool: key j is visible to query i (causal, optional window).

    With `first` (..., len(q_pos)), each query's document start, also k_pos >= first: shape (..., Tq, Tk)."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    if first is not None:
        visible = visible & (k_pos >= first[..., None])
    return visible


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is reduced in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_head_params(h, d, len_gain, null_base, null_slope, mag_beta, v_null, window) -> None:
    """The per-head scalars (H,), v_null (H, D) and the window, for H query heads of size D."""
    for name, p in (
        ("len_gain", len_gain),
        ("null_base", null_base),
        ("null_slope", null_slope),
        ("mag_beta", mag_beta),
    ):
        if p.shape != (h,):
            raise ValueError(f"{name} must have shape ({h},), got {tuple(p.shape)}")
    if v_null.shape != (h, d):
        raise ValueError(f"v_null must have shape ({h}, {d}), got {tuple(v_null.shape)}")
    if window < 0:
        raise ValueError("window must be >= 0 (0 means no window)")


def _check_inputs(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window, doc_start=None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, T, H, D)")
    b, tq, h, d = q.shape
    bk, tk, hkv, dk = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)}")
    if bk != b or dk != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"query heads {h} must be a multiple of KV heads {hkv}")
    if tq > tk:
        raise ValueError(f"Tq={tq} queries cannot exceed Tk={tk} keys")
    _check_head_params(h, d, len_gain, null_base, null_slope, mag_beta, v_null, window)
    check_doc_start(doc_start, b, tk)  # indexed by key position: (B, Tk)


# ----------------------------------------------------------------------------------------------
# Materialised reference
# ----------------------------------------------------------------------------------------------


def polar_attention_naive(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, *, window=0, doc_start=None):
    """Polar attention with the full (B, H, Tq, Tk) weight matrix; autograd gives the backward.

    doc_start: None or int32 (B, Tk), queries see their own document only (module docstring).
    Returns c (B, Tq, H, D) and mag (B, Tq, H), both in q's dtype.
    """
    _check_inputs(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window, doc_start)
    cd = compute_dtype(q.dtype)
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    group = h // hkv

    qh = q.to(cd).transpose(1, 2)  # (B, H, Tq, D)
    kh = k.to(cd).repeat_interleave(group, dim=2).transpose(1, 2)  # (B, H, Tk, D)
    vh = v.to(cd).repeat_interleave(group, dim=2).transpose(1, 2)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(d)

    n = visible_key_counts(tq, tk, window, q.device, doc_start).to(cd)
    first = None
    if doc_start is not None:  # per (batch, query): n (B, 1, Tq) gives (B, H, Tq) scalars, a (B, 1, Tq, Tk) mask
        n, first = n[:, None, :], query_doc_starts(tq, doc_start)[:, None, :]
    temp, null = polar_scalars(
        n, len_gain.to(cd)[:, None], null_base.to(cd)[:, None], null_slope.to(cd)[:, None]
    )  # (H, Tq), or (B, H, Tq) with documents
    visible = visibility_mask(query_positions(tq, tk, q.device), torch.arange(tk, device=q.device), window, first)
    # temp multiplies finite scores; the mask comes after (-inf * temp has NaN gradients).
    key_logits = (temp[..., None] * scores).masked_fill(~visible, float("-inf"))
    null_logit = (temp * null).expand(b, h, tq)[..., None]
    weights = torch.softmax(torch.cat([key_logits, null_logit], dim=-1), dim=-1)
    w_keys, w_null = weights[..., :-1], weights[..., -1]

    s_vec = w_keys @ vh + w_null[..., None] * v_null.to(cd)[:, None, :]
    c = s_vec / s_vec.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    # sum_j w_ij equals 1 - w_iN without the cancellation when the null takes nearly all the mass.
    real_mass = w_keys.sum(-1)
    n_eff = 1.0 / ((w_keys / real_mass[..., None]) ** 2).sum(-1)
    m_eff = n_eff * real_mass
    mag = torch.tanh(F.softplus(mag_beta.to(cd))[:, None] * torch.log1p(m_eff))
    return c.transpose(1, 2).to(q.dtype), mag.transpose(1, 2).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Decode reference: one query per sequence over a paged KV cache
# ----------------------------------------------------------------------------------------------


def _check_decode_inputs(
    q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope, mag_beta, v_null, window
) -> None:
    """Shapes and dtypes of a paged decode call (layouts in `polar_decode_reference`); no data is read."""
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, D), got {tuple(q.shape)}")
    if k_pages.dim() != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"k_pages, v_pages must both be (num_pages, page_size, Hkv, D), got {tuple(k_pages.shape)} and "
            f"{tuple(v_pages.shape)}"
        )
    b, h, d = q.shape
    _, page_size, hkv, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"q head_dim {d} and the pages' head_dim {dk} differ")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"query heads {h} must be a multiple of KV heads {hkv}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.shape[1] == 0:
        raise ValueError(f"block_table must be (B={b}, max_blocks >= 1), got {tuple(block_table.shape)}")
    if context_lens.shape != (b,):
        raise ValueError(f"context_lens must have shape ({b},), got {tuple(context_lens.shape)}")
    for name, x in (("block_table", block_table), ("context_lens", context_lens)):
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor (int32), got {x.dtype}")
    _check_head_params(h, d, len_gain, null_base, null_slope, mag_beta, v_null, window)


def _check_decode_lengths(context_lens: torch.Tensor, capacity: int) -> None:
    """1 <= context_lens <= max_blocks * page_size. Reads the values: CPU tensors only (no device sync)."""
    if context_lens.device.type != "cpu" or context_lens.numel() == 0:
        return
    lo, hi = int(context_lens.min()), int(context_lens.max())
    if lo < 1 or hi > capacity:
        raise ValueError(f"context_lens must lie in [1, max_blocks * page_size = {capacity}], got [{lo}, {hi}]")


def polar_decode_reference(
    q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope, mag_beta, v_null, *, window=0
):
    """Polar attention of one decode query per sequence over a paged KV cache (plain PyTorch).

    q (B, H, D); k_pages, v_pages (num_pages, page_size, Hkv, D); block_table (B, max_blocks) int32
    (block_table[b, j] holds positions j * page_size .. (j + 1) * page_size - 1 of sequence b);
    context_lens (B,) int32 >= 1. The query of sequence b sits at position context_lens[b] - 1 and sees
    keys 0 .. context_lens[b] - 1 (its own key is already cached), the last `window` of them when
    window > 0, so n_b = min(context_lens[b], window): the last row of `polar_attention_naive` over the
    same keys. Query head h reads KV head h // (H // Hkv). len_gain, null_base, null_slope, mag_beta (H,)
    and v_null (H, D) are the raw parameters. Returns c (B, H, D) and mag (B, H) in q's dtype, computed in
    float32 (float64 for float64 q). The pages are gathered and masked (kernels/paged.py), so every entry
    of the block table must be a valid page index.
    """
    _check_decode_inputs(
        q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope, mag_beta, v_null, window
    )
    b, h, d = q.shape
    hkv = k_pages.shape[2]
    _check_decode_lengths(context_lens, block_table.shape[1] * k_pages.shape[1])
    cd = compute_dtype(q.dtype)
    k = gather_pages(k_pages, block_table).to(cd)  # (B, T, Hkv, D)
    v = gather_pages(v_pages, block_table).to(cd)
    visible = key_mask(context_lens, k.shape[1], window)  # (B, T)

    qg = q.to(cd).reshape(b, hkv, h // hkv, d)  # query head h = kv * G + g
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k).reshape(b, h, -1) / math.sqrt(d)  # (B, H, T)
    n = context_lens.to(cd)
    if window > 0:
        n = n.clamp_max(window)
    temp, null = polar_scalars(n[:, None], len_gain.to(cd), null_base.to(cd), null_slope.to(cd))  # (B, H)
    key_logits = (temp[..., None] * scores).masked_fill(~visible[:, None, :], float("-inf"))
    weights = torch.softmax(torch.cat([key_logits, (temp * null)[..., None]], dim=-1), dim=-1)
    w_keys, w_null = weights[..., :-1], weights[..., -1]

    s_vec = torch.einsum("bkgt,btkd->bkgd", w_keys.reshape(b, hkv, h // hkv, -1), v).reshape(b, h, d)
    s_vec = s_vec + w_null[..., None] * v_null.to(cd)
    c = s_vec / s_vec.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    real_mass = w_keys.sum(-1)
    n_eff = 1.0 / ((w_keys / real_mass[..., None]) ** 2).sum(-1)
    mag = torch.tanh(F.softplus(mag_beta.to(cd)) * torch.log1p(n_eff * real_mass))
    return c.to(q.dtype), mag.to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Streaming reference: layout helpers
# ----------------------------------------------------------------------------------------------
# Internally query tensors are (B, Hkv, G, Tq, ...) and KV tensors (B, Hkv, Tk, D): the G query
# heads sharing a KV head are flattened with their queries into one (G * block_q) row dimension, so
# each tile is one batched matmul against the shared KV tile and GQA never copies K or V.


def _query_heads(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, T, H, ...) -> view (B, Hkv, G, T, ...)."""
    b, t, h = x.shape[:3]
    x = x.reshape(b, t, hkv, h // hkv, *x.shape[3:])
    return x.movedim(1, 3)


def _merge_query_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, G, T, ...) -> (B, T, H, ...)."""
    x = x.movedim(3, 1)
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def _kv_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, T, Hkv, D) -> view (B, Hkv, T, D)."""
    return x.transpose(1, 2)


def _per_head(p: torch.Tensor, hkv: int, cd: torch.dtype) -> torch.Tensor:
    """(H, ...) -> (Hkv, G, ...)."""
    return p.to(cd).reshape(hkv, p.shape[0] // hkv, *p.shape[1:])


def _sum_to_head(x: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, G, T, ...) -> (H, ...): reduce over batch and queries."""
    x = x.sum(dim=(0, 3))
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _query_blocks(tq: int, block_q: int):
    """(lo, hi) query index ranges of the query tiles; the last one may be short."""
    for lo in range(0, tq, block_q):
        yield lo, min(lo + block_q, tq)


def _key_blocks(first_pos: int, last_pos: int, window: int, block_k: int, doc_first: int = 0):
    """Key tiles (aligned to multiples of block_k) holding a key visible to query positions
    first_pos..last_pos; the tiles wholly in the causal future or before the window are skipped, and
    so are those before `doc_first`, where the first query's document begins (doc_start does not
    decrease, so no later query sees a key before it)."""
    first_key = max(0, first_pos - window + 1) if window > 0 else 0
    first_key = max(first_key, doc_first)
    for lo in range((first_key // block_k) * block_k, last_pos + 1, block_k):
        yield lo, min(lo + block_k, last_pos + 1)


class _Layout:
    """Shapes and per-query constants shared by forward and backward."""

    def __init__(self, q, k, window, cd, doc_start=None):
        self.b, self.tq, self.h, self.d = q.shape
        self.tk, self.hkv = k.shape[1], k.shape[2]
        self.g = self.h // self.hkv
        self.window = window
        self.cd = cd
        self.scale = 1.0 / math.sqrt(self.d)
        self.offset = self.tk - self.tq  # query i sits at key position offset + i
        self.q_pos = query_positions(self.tq, self.tk, q.device)
        self.n = visible_key_counts(self.tq, self.tk, window, q.device, doc_start).to(cd)
        self.first = None  # each query's document start, (B, 1, 1, Tq), with documents
        self.block_first = None  # the earliest of them over the batch, per query (host ints): skips tiles
        if doc_start is not None:
            first = query_doc_starts(self.tq, doc_start)
            self.first = first[:, None, None, :]
            self.n = self.n[:, None, None, :]  # per (batch, query): (B, Hkv, G, Tq) scalars
            # reading the starts is a device sync, and a graph break when compiled: there the mask alone works
            if doc_start.device.type == "cpu" and not torch.compiler.is_compiling():
                self.block_first = first.amin(dim=0).tolist()

    def key_blocks(self, q_lo: int, q_hi: int, block_k: int):
        """The key tiles the queries q_lo..q_hi - 1 see (`_key_blocks`)."""
        doc_first = 0 if self.block_first is None else self.block_first[q_lo]
        return _key_blocks(self.offset + q_lo, self.offset + q_hi - 1, self.window, block_k, doc_first)

    def q_tile(self, qh: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """(B, Hkv, G, Tq, D) slice -> (B, Hkv, G * bq, D) in compute dtype."""
        return qh[:, :, :, lo:hi].to(self.cd).reshape(self.b, self.hkv, self.g * (hi - lo), self.d)

    def kv_tile(self, xh: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return xh[:, :, lo:hi].to(self.cd)

    def rows(self, x: torch.Tensor, bq: int) -> torch.Tensor:
        """(B, Hkv, G*bq, ...) -> (B, Hkv, G, bq, ...)."""
        return x.reshape(self.b, self.hkv, self.g, bq, *x.shape[3:])

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, G, bq, ...) -> (B, Hkv, G*bq, ...)."""
        return x.reshape(self.b, self.hkv, self.g * x.shape[3], *x.shape[4:])


def _score_tile(layout: _Layout, q_tile, k_tile, temp_tile, q_lo, q_hi, k_lo, k_hi):
    """Scores s and masked logits a = temp * s for one tile, both (B, Hkv, G, bq, bk)."""
    s = layout.rows(q_tile @ k_tile.transpose(-1, -2), q_hi - q_lo) * layout.scale
    k_pos = torch.arange(k_lo, k_hi, device=s.device)
    first = None if layout.first is None else layout.first[..., q_lo:q_hi]
    visible = visibility_mask(layout.q_pos[q_lo:q_hi], k_pos, layout.window, first)
    a = (temp_tile[..., None] * s).masked_fill(~visible, float("-inf"))
    return s, a


# ----------------------------------------------------------------------------------------------
# Streaming reference: per-query readout shared by forward and backward
# ----------------------------------------------------------------------------------------------


class _Readout:
    """Per-query quantities that follow from (m, l, q2) and the null logit a_N."""

    def __init__(self, m, l, q2, null_logit, mag_slope):
        self.lse_keys = m + torch.log(l)  # log sum_j e^(a_j) over real keys
        self.keep = torch.sigmoid(self.lse_keys - null_logit)  # 1 - w_N = l / Z
        self.w_null = torch.sigmoid(null_logit - self.lse_keys)  # w_N = p_N / Z
        self.n_eff = l * l / q2
        self.m_eff = self.n_eff * self.keep
        self.mag = torch.tanh(mag_slope * torch.log1p(self.m_eff))


# ----------------------------------------------------------------------------------------------
# Streaming reference: forward
# ----------------------------------------------------------------------------------------------


def _forward_key_sweep(layout: _Layout, q_tile, kh, vh, temp_tile, q_lo, q_hi, block_k):
    """Online softmax over the visible key tiles of one query tile: returns m, l, q2, acc."""
    shape = (layout.b, layout.hkv, layout.g, q_hi - q_lo)
    m = q_tile.new_full(shape, float("-inf"))
    l = q_tile.new_zeros(shape)
    q2 = q_tile.new_zeros(shape)
    acc = q_tile.new_zeros(*shape, layout.d)
    for k_lo, k_hi in layout.key_blocks(q_lo, q_hi, block_k):
        k_tile, v_tile = layout.kv_tile(kh, k_lo, k_hi), layout.kv_tile(vh, k_lo, k_hi)
        _, a = _score_tile(layout, q_tile, k_tile, temp_tile, q_lo, q_hi, k_lo, k_hi)
        m_new = torch.maximum(m, a.amax(dim=-1))
        # rows with no visible key so far keep m = -inf; subtract 0 there instead of -inf (NaN)
        m_ref = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        rescale = torch.exp(m - m_ref)
        p = torch.exp(a - m_ref[..., None])
        l = rescale * l + p.sum(dim=-1)
        q2 = rescale * rescale * q2 + (p * p).sum(dim=-1)
        acc = rescale[..., None] * acc + layout.rows(layout.flat(p) @ v_tile, q_hi - q_lo)
        m = m_new
    return m, l, q2, acc


def _polar_forward(layout: _Layout, q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, block_q, block_k):
    cd, hkv = layout.cd, layout.hkv
    qh, kh, vh = _query_heads(q, hkv), _kv_heads(k), _kv_heads(v)
    temp, null = polar_scalars(
        layout.n,
        _per_head(len_gain, hkv, cd)[..., None],
        _per_head(null_base, hkv, cd)[..., None],
        _per_head(null_slope, hkv, cd)[..., None],
    )  # (Hkv, G, Tq)
    null_logit = temp * null
    mag_slope = F.softplus(_per_head(mag_beta, hkv, cd))[..., None]
    v_null_h = _per_head(v_null, hkv, cd)[:, :, None, :]  # (Hkv, G, 1, D)

    stats_shape = (layout.b, hkv, layout.g, layout.tq)
    m, l, q2 = (q.new_empty(stats_shape, dtype=cd) for _ in range(3))
    s_norm, mag = q.new_empty(stats_shape, dtype=cd), q.new_empty(stats_shape, dtype=cd)
    c = q.new_empty(*stats_shape, layout.d, dtype=cd)
    for q_lo, q_hi in _query_blocks(layout.tq, block_q):
        q_tile = layout.q_tile(qh, q_lo, q_hi)
        m_b, l_b, q2_b, acc = _forward_key_sweep(layout, q_tile, kh, vh, temp[..., q_lo:q_hi], q_lo, q_hi, block_k)
        # fold in the null entry once, after the last key tile
        out = _Readout(m_b, l_b, q2_b, null_logit[..., q_lo:q_hi], mag_slope)
        s_vec = out.keep[..., None] * acc / l_b[..., None] + out.w_null[..., None] * v_null_h
        norm = s_vec.norm(dim=-1)
        c[..., q_lo:q_hi, :] = s_vec / norm.clamp_min(NORM_EPS)[..., None]
        m[..., q_lo:q_hi], l[..., q_lo:q_hi], q2[..., q_lo:q_hi] = m_b, l_b, q2_b
        s_norm[..., q_lo:q_hi], mag[..., q_lo:q_hi] = norm, out.mag
    return c, mag, (m, l, q2, s_norm)


# ----------------------------------------------------------------------------------------------
# Streaming reference: backward
# ----------------------------------------------------------------------------------------------


class _Preamble:
    """Per-query backward scalars (the g_s, g_me, g_l, g_q2 of docs/model.md section 3.7 at the l = 1 normalisation)."""

    def __init__(self, out: _Readout, c, s_norm, g_c, g_mag, mag_slope, v_null_h):
        unclamped = s_norm > NORM_EPS
        s_vec = c * s_norm.clamp_min(NORM_EPS)[..., None]
        # c = s_vec / ||s_vec||: project out the radial part; clamped: c = s_vec / eps, plain scaling
        radial = torch.where(unclamped, (g_c * c).sum(-1), torch.zeros_like(s_norm))
        self.g_s = (g_c - radial[..., None] * c) / s_norm.clamp_min(NORM_EPS)[..., None]
        self.delta = (self.g_s * s_vec).sum(-1)  # zero unless clamped; kept for exactness
        self.g_me = g_mag * mag_slope * (1 - out.mag * out.mag) / (1 + out.m_eff)
        self.g_l = self.g_me * out.m_eff * (3 - out.keep)
        self.g_q2 = -self.g_me * out.m_eff * out.n_eff
        # per-key constant part of dL/dp_j, and g_s scaled to the l = 1 weights p_j (w_j = keep p_j)
        self.dp_const = self.g_l - out.keep * self.delta
        self.g_acc = out.keep[..., None] * self.g_s
        # the null entry: da_N = p_N dL/dp_N, with dm_eff/dp_N = -m_eff / Z
        g_s_dot_v_null = (self.g_s * v_null_h).sum(-1)
        self.da_null = out.w_null * (g_s_dot_v_null - self.delta - self.g_me * out.m_eff)
        # delta - A, with A = sum_j p_j g_acc.v_j from the key sweep: see _consistent_delta_fix
        self.delta_rest = out.w_null * g_s_dot_v_null - self.delta


def _backward_key_sweep(layout: _Layout, q_tile, kh, vh, temp_tile, lse_tile, pre_tile, q_lo, q_hi, block_k, dk, dv):
    """Recompute the key tiles of one query tile, adding into dk, dv.

    Returns dq_tile and three per-query row sums: sum_j da_j s_j, A = sum_j p_j g_acc.v_j and
    S0 = sum_j p_j s_j (the last two for _consistent_delta_fix).
    """
    g_acc, dp_const, g_q2 = pre_tile
    g_acc_flat = layout.flat(g_acc)
    dq = torch.zeros_like(q_tile)
    da_dot_s = dp_const.new_zeros(dp_const.shape)
    p_dot_g = torch.zeros_like(da_dot_s)
    p_dot_s = torch.zeros_like(da_dot_s)
    for k_lo, k_hi in layout.key_blocks(q_lo, q_hi, block_k):
        k_tile, v_tile = layout.kv_tile(kh, k_lo, k_hi), layout.kv_tile(vh, k_lo, k_hi)
        s, a = _score_tile(layout, q_tile, k_tile, temp_tile, q_lo, q_hi, k_lo, k_hi)
        p = torch.exp(a - lse_tile[..., None])  # weights among real keys (l = 1); masked -> 0
        g_s_dot_v = layout.rows(g_acc_flat @ v_tile.transpose(-1, -2), q_hi - q_lo)
        dl_dp = g_s_dot_v + dp_const[..., None] + 2 * g_q2[..., None] * p
        da = p * dl_dp
        da_dot_s += (da * s).sum(-1)
        p_dot_g += (p * g_s_dot_v).sum(-1)
        p_dot_s += (p * s).sum(-1)
        ds = layout.flat(temp_tile[..., None] * da) * layout.scale  # includes d s / d (q.k)
        dq += ds @ k_tile
        dk[:, :, k_lo:k_hi] += ds.transpose(-1, -2) @ q_tile  # sums the G query heads
        dv[:, :, k_lo:k_hi] += layout.flat(p).transpose(-1, -2) @ g_acc_flat
    return dq, da_dot_s, p_dot_g, p_dot_s


def _consistent_delta_fix(da_dot_s, da_null, p_dot_g, p_dot_s, delta_rest, keep, w_null):
    """Recompute delta = g_s.s_vec from the key sweep's own products; returns fixed (sum_j da_j s_j, da_N).

    The preamble's delta comes from c, saved in the input dtype, so in bf16 it is off by ~2^-8 relative
    from the g_acc.v_j the sweep multiplies exactly. The exact softmax identity sum_j da_j + da_N = 0
    (shift invariance) then fails by keep * (delta' - delta), and d temp picks up a per-query bias
    ~ (delta' - delta) * sum_j p_j s_j that does not cancel across queries, swamping d len_gain (a small
    residual). With s_vec = keep sum_j p_j v_j + w_N v_null, the consistent value is
    delta' = A + w_N g_s.v_null = A + delta_rest + delta, A = sum_j p_j g_acc.v_j. Swapping delta for
    delta' shifts every dL/dp_j by -keep r (r = delta' - delta = A + delta_rest), hence
    sum_j da_j s_j by -keep r S0 (S0 = sum_j p_j s_j), and da_N by -w_N r. dq, dk, dv keep the
    preamble's delta (FlashAttention's D = rowsum(dO * O) has the same size of error).
    """
    r = p_dot_g + delta_rest
    return da_dot_s - keep * r * p_dot_s, da_null - w_null * r


def _polar_backward(layout: _Layout, saved, g_c, g_mag, block_q, block_k):
    q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, c, m, l, q2, s_norm = saved
    cd, hkv = layout.cd, layout.hkv
    qh, kh, vh = _query_heads(q, hkv), _kv_heads(k), _kv_heads(v)
    alpha, base, gamma = (_per_head(p, hkv, cd)[..., None] for p in (len_gain, null_base, null_slope))
    beta = _per_head(mag_beta, hkv, cd)[..., None]
    temp, null = polar_scalars(layout.n, alpha, base, gamma)
    mag_slope = F.softplus(beta)
    v_null_h = _per_head(v_null, hkv, cd)[:, :, None, :]

    out = _Readout(m, l, q2, temp * null, mag_slope)
    g_c = _query_heads(g_c, hkv).to(cd)
    g_mag = _query_heads(g_mag, hkv).to(cd)
    pre = _Preamble(out, _query_heads(c, hkv).to(cd), s_norm, g_c, g_mag, mag_slope, v_null_h)

    dq = q.new_empty(layout.b, hkv, layout.g, layout.tq, layout.d, dtype=cd)
    dk = q.new_zeros(layout.b, hkv, layout.tk, layout.d, dtype=cd)
    dv = torch.zeros_like(dk)
    da_dot_s, p_dot_g, p_dot_s = (q.new_empty(layout.b, hkv, layout.g, layout.tq, dtype=cd) for _ in range(3))
    for q_lo, q_hi in _query_blocks(layout.tq, block_q):
        sl = slice(q_lo, q_hi)
        pre_tile = (pre.g_acc[..., sl, :], pre.dp_const[..., sl], pre.g_q2[..., sl])
        dq_tile, da_dot_s[..., sl], p_dot_g[..., sl], p_dot_s[..., sl] = _backward_key_sweep(
            layout,
            layout.q_tile(qh, q_lo, q_hi),
            kh,
            vh,
            temp[..., sl],
            out.lse_keys[..., sl],
            pre_tile,
            q_lo,
            q_hi,
            block_k,
            dk,
            dv,
        )
        dq[..., sl, :] = layout.rows(dq_tile, q_hi - q_lo)

    da_dot_s, da_null = _consistent_delta_fix(
        da_dot_s, pre.da_null, p_dot_g, p_dot_s, pre.delta_rest, out.keep, out.w_null
    )
    # per-head scalars: a_j = temp s_j and a_N = temp null
    d_temp = da_dot_s + da_null * null
    d_null = da_null * temp
    d_len_gain = _sum_to_head(d_temp * torch.log(layout.n)) * torch.sigmoid(alpha[..., 0]).flatten()
    d_null_base = _sum_to_head(d_null)
    d_null_slope = _sum_to_head(d_null * torch.sqrt(torch.log1p(layout.n))) * torch.sigmoid(gamma[..., 0]).flatten()
    d_mag_beta = (
        _sum_to_head(g_mag * (1 - out.mag * out.mag) * torch.log1p(out.m_eff)) * torch.sigmoid(beta[..., 0]).flatten()
    )
    d_v_null = _sum_to_head(out.w_null[..., None] * pre.g_s)
    return (
        _merge_query_heads(dq),
        dk.transpose(1, 2),
        dv.transpose(1, 2),
        d_len_gain,
        d_null_base,
        d_null_slope,
        d_mag_beta,
        d_v_null,
    )


def _as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype, itself when it already is: under torch.compile, torch 2.11 drops the gradient of a Function's
    output that is a same-dtype .to() of an intermediate (2.13 does not)."""
    return x if x.dtype == dtype else x.to(dtype)


class PolarAttentionFunction(torch.autograd.Function):
    """Streaming Polar attention; saves inputs, c and per-query (m, l, q2, ||s_vec||) only."""

    @staticmethod
    def forward(ctx, q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window, block_q, block_k, doc_start):
        layout = _Layout(q, k, window, compute_dtype(q.dtype), doc_start)
        c, mag, stats = _polar_forward(
            layout, q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, block_q, block_k
        )
        c_out = _as_dtype(_merge_query_heads(c), q.dtype)
        mag_out = _as_dtype(_merge_query_heads(mag), q.dtype)
        # c is kept in the output dtype, as a kernel would; mag is recomputed from (l, q2) in backward
        ctx.save_for_backward(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, c_out, *stats, doc_start)
        ctx.window, ctx.block_q, ctx.block_k = window, block_q, block_k
        return c_out, mag_out

    @staticmethod
    def backward(ctx, g_c, g_mag):
        *saved, doc_start = ctx.saved_tensors
        q, k = saved[0], saved[1]
        layout = _Layout(q, k, ctx.window, compute_dtype(q.dtype), doc_start)
        grads = _polar_backward(layout, saved, g_c, g_mag, ctx.block_q, ctx.block_k)
        inputs = saved[:8]
        grads = tuple(g.to(x.dtype) if need else None for g, x, need in zip(grads, inputs, ctx.needs_input_grad[:8]))
        return (*grads, None, None, None, None)


def polar_attention_reference(
    q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, *, window=0, block_q=128, block_k=128, doc_start=None
):
    """Streaming Polar attention in O(T * block) memory; see the module docstring.

    q (B, Tq, H, D); k, v (B, Tk, Hkv, D) with Tq <= Tk (queries are the last Tq positions);
    len_gain, null_base, null_slope, mag_beta (H,); v_null (H, D); doc_start None or int32 (B, Tk)
    (kernels/documents.py). Returns c (B, Tq, H, D) and mag (B, Tq, H) in q's dtype.
    """
    _check_inputs(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window, doc_start)
    if block_q <= 0 or block_k <= 0:
        raise ValueError("block sizes must be positive")
    return PolarAttentionFunction.apply(
        q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window, block_q, block_k, doc_start
    )
