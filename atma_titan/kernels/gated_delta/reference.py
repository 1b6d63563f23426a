"""Plain-PyTorch references for the gated delta rule (docs/model.md section 4).

Per head, with a matrix state M (Dv x Dk):

    M_t = gamma_t * M_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,      r_t = M_t q_t

With ||k_t|| = 1 and beta_t in (0, 1), I - beta_t k_t k_t^T has eigenvalues in [1 - beta_t, 1],
so every step is non-expansive: ||M_t||_2 <= gamma_t ||M_{t-1}||_2 + beta_t ||v_t||.

Chunked derivation. Rewrite one step as M_t = gamma_t M_{t-1} + u_t k_t^T with the "delta"
u_t = beta_t (v_t - gamma_t M_{t-1} k_t). Inside a chunk that starts from state S, let
g_t = sum_{s<=t} log gamma_s (cumulative log decay from the chunk start) and G_t = exp(g_t). Then

    M_t = G_t S + sum_{s<=t} exp(g_t - g_s) u_s k_s^T,

and substituting M_{t-1} into u_t gives a unit lower-triangular system (the UT transform)

    (I + A) U = diag(beta) V - diag(beta G) K S^T,   A_ts = beta_t exp(g_t - g_s) k_t.k_s  (s < t)

so U = U~ - W S^T with U~ = (I + A)^{-1} diag(beta) V and W = (I + A)^{-1} diag(beta G) K, both
independent of S and computed for all chunks at once. Per chunk, sequentially:

    R     = diag(G) Q S^T + (Q K^T * D) U           D_ts = exp(g_t - g_s) for s <= t, else 0
    S_new = G_C S + U^T diag(exp(g_C - g)) K        (one state hand-off per chunk)

Documents (`doc_start`, kernels/documents.py): at every t > 0 where a document begins the state is
zeroed before step t (M_{t-1} := 0), so gamma_t has no effect there. In the chunked form, seg_t counts
the resets at rows <= t of the chunk; everything that carries the state across a reset is masked out:
D_ts and A_ts keep only seg_t == seg_s, G_t only seg_t == 0, exp(g_C - g_s) only seg_s == seg_C and G_C
only a chunk without resets. g stays a cumulative sum within the chunk, with log_gamma set to 0 at the
resets: that moves g by a constant within each later segment, which every masked term cancels, and
makes the resets' log_gamma gradient exactly zero.

Layout: q, k (B, T, H, Dk); v (B, T, H, Dv); log_gamma, beta (B, T, H); state (B, H, Dv, Dk).
All arithmetic is float32 (float64 if any of q, k, v is float64); r comes back in v's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atma_titan.kernels.documents import check_doc_start, document_resets

__all__ = ["gated_delta_recurrent", "gated_delta_chunked", "gated_delta_step", "gated_delta_step_inplace"]

L2_NORM_EPS = 1e-6


def gated_delta_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule, inputs used exactly as given (no normalisation, no casts).

    state (B, H, Dv, Dk); q, k (B, H, Dk); v (B, H, Dv); log_gamma, beta (B, H).
    Returns (r (B, H, Dv), new_state (B, H, Dv, Dk)). Not in-place: the old state is kept intact.
    """
    gamma = log_gamma.exp()[..., None, None]
    strength = beta[..., None, None]
    state_k = state @ k.unsqueeze(-1)  # M k, (B, H, Dv, 1)
    erased = state - strength * (state_k @ k.unsqueeze(-2))  # M (I - beta k k^T)
    new_state = gamma * erased + strength * (v.unsqueeze(-1) @ k.unsqueeze(-2))
    r = (new_state @ q.unsqueeze(-1)).squeeze(-1)
    return r, new_state


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    normalize_qk: bool = True,
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ground truth: the exact per-token recurrence, a Python loop over t.

    doc_start (B, T) int: the state is zeroed before each document start t > 0 (kernels/documents.py).
    Returns (r (B, T, H, Dv) in v's dtype, final_state (B, H, Dv, Dk) in the compute dtype).
    """
    _check_shapes(q, k, v, log_gamma, beta, initial_state, doc_start)
    dtype, out_dtype = _compute_dtype(q, k, v), v.dtype
    q, k, v, log_gamma, beta = _to_head_major(q, k, v, log_gamma, beta, dtype, normalize_qk)
    state = _initial_state(initial_state, q, v, dtype)
    resets = None if doc_start is None else document_resets(doc_start)[:, :, None, None, None]  # (B, T, 1, 1, 1)

    outputs = []
    for t in range(q.shape[2]):
        if resets is not None:
            state = state.masked_fill(resets[:, t], 0.0)
        r_t, state = gated_delta_step(state, q[:, :, t], k[:, :, t], v[:, :, t], log_gamma[:, :, t], beta[:, :, t])
        outputs.append(r_t)
    r = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape)
    return _to_time_major(r).to(out_dtype), state


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    normalize_qk: bool = True,
    chunk_size: int = 64,
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT) form of the same recurrence; differentiable by plain autograd.

    Same arguments and results as gated_delta_recurrent. A tail shorter than chunk_size is padded
    with beta = 0, log_gamma = 0 (an identity step), so it changes neither r nor the state.
    Document resets are exact anywhere in a chunk (segment masks, see the module docstring).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_shapes(q, k, v, log_gamma, beta, initial_state, doc_start)
    dtype, out_dtype = _compute_dtype(q, k, v), v.dtype
    q, k, v, log_gamma, beta = _to_head_major(q, k, v, log_gamma, beta, dtype, normalize_qk)
    state = _initial_state(initial_state, q, v, dtype)
    seq_len = q.shape[2]
    if seq_len == 0:
        return _to_time_major(v).to(out_dtype), state

    chunk = min(chunk_size, seq_len)  # no point padding past the sequence
    segments = None
    if doc_start is not None:
        resets = document_resets(doc_start).unsqueeze(1)  # (B, 1, T), shared by the heads
        log_gamma = log_gamma.masked_fill(resets, 0.0)  # a reset's gamma multiplies a zeroed state
        segments = _split_chunks(resets.long(), chunk).cumsum(dim=-1)  # seg_t, (B, 1, N, C)
    q, k, v, log_gamma, beta = (_split_chunks(x, chunk) for x in (q, k, v, log_gamma, beta))
    log_decay = log_gamma.cumsum(dim=-1)  # g_t, (B, H, N, C)
    causal_decay = _causal_decay_matrix(log_decay, segments)  # D, (B, H, N, C, C)
    # G_t, taken twice: one exp shared by the UT transform and q_from_start would add their gradients before
    # the product and round differently from the form without documents (whose runs stay bit for bit).
    at_start = None if segments is None else segments == 0
    w, u_tilde = _ut_transform(k, v, beta, _masked_exp(log_decay, at_start), causal_decay)

    intra_scores = (q @ k.transpose(-1, -2)) * causal_decay
    q_from_start = q * _masked_exp(log_decay, at_start).unsqueeze(-1)  # G_t q_t: reads the chunk's start state
    last_segment = None if segments is None else segments == segments[..., -1:]
    k_to_end = k * _masked_exp(log_decay[..., -1:] - log_decay, last_segment).unsqueeze(-1)  # writes to chunk end
    no_reset = None if segments is None else segments[..., -1] == 0
    chunk_decay = _masked_exp(log_decay[..., -1], no_reset)[..., None, None]  # G_C, (B, H, N, 1, 1)

    outputs = []
    for n in range(q.shape[2]):
        delta = u_tilde[:, :, n] - w[:, :, n] @ state.transpose(-1, -2)  # U, (B, H, C, Dv)
        outputs.append(q_from_start[:, :, n] @ state.transpose(-1, -2) + intra_scores[:, :, n] @ delta)
        state = chunk_decay[:, :, n] * state + delta.transpose(-1, -2) @ k_to_end[:, :, n]
    r = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :seq_len]
    return _to_time_major(r).to(out_dtype), state


def _ut_transform(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    from_start: torch.Tensor,
    causal_decay: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W = (I + A)^{-1} diag(beta G) K and U~ = (I + A)^{-1} diag(beta) V for every chunk at once."""
    key_overlap = (k @ k.transpose(-1, -2)) * causal_decay
    strictly_lower = (beta.unsqueeze(-1) * key_overlap).tril(diagonal=-1)
    eye = torch.eye(k.shape[-2], dtype=k.dtype, device=k.device)
    system = eye + strictly_lower
    rhs = torch.cat([(beta * from_start).unsqueeze(-1) * k, beta.unsqueeze(-1) * v], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    return solved.split([k.shape[-1], v.shape[-1]], dim=-1)


def _causal_decay_matrix(log_decay: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    """exp(g_t - g_s) for s <= t (and seg_s == seg_t with documents), 0 elsewhere.

    The mask is applied in log space before exp: above the diagonal g_t - g_s > 0 can overflow,
    and a masked inf would turn into NaN gradients.
    """
    diff = log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)
    size = log_decay.shape[-1]
    keep = torch.ones(size, size, dtype=torch.bool, device=log_decay.device).tril()
    if segments is not None:
        keep = keep & (segments.unsqueeze(-1) == segments.unsqueeze(-2))
    return diff.masked_fill(~keep, float("-inf")).exp()


def _masked_exp(log_x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """exp(log_x) where keep (everywhere if keep is None), exactly 0 elsewhere (masked in log space)."""
    if keep is None:
        return log_x.exp()
    return log_x.masked_fill(~keep, float("-inf")).exp()


def _split_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, H, T, ...) -> (B, H, N, chunk, ...), zero-padding the time axis to a multiple of chunk.

    Zero padding is an identity step: beta = 0 writes nothing, log_gamma = 0 keeps the state.
    """
    seq_len = x.shape[2]
    pad = -seq_len % chunk
    if pad:
        trailing = x.dim() - 3  # dims after T
        x = F.pad(x, (0, 0) * trailing + (0, pad))
    return x.unflatten(2, (x.shape[2] // chunk, chunk))


def _to_head_major(q, k, v, log_gamma, beta, dtype, normalize_qk):
    """Cast to the compute dtype, optionally L2-normalise q and k, move T next to the feature axis."""
    q, k, v, log_gamma, beta = (x.to(dtype) for x in (q, k, v, log_gamma, beta))
    if normalize_qk:
        q = F.normalize(q, dim=-1, eps=L2_NORM_EPS)
        k = F.normalize(k, dim=-1, eps=L2_NORM_EPS)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
    log_gamma, beta = (x.transpose(1, 2) for x in (log_gamma, beta))  # (B, H, T)
    return q, k, v, log_gamma, beta


def _to_time_major(r: torch.Tensor) -> torch.Tensor:
    return r.transpose(1, 2)  # (B, H, T, Dv) -> (B, T, H, Dv)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in tensors) else torch.float32


def _initial_state(initial_state, q, v, dtype) -> torch.Tensor:
    batch, heads, _, key_dim = q.shape
    if initial_state is None:
        return torch.zeros(batch, heads, v.shape[-1], key_dim, dtype=dtype, device=q.device)
    return initial_state.to(dtype)


def _check_shapes(q, k, v, log_gamma, beta, initial_state, doc_start=None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, T, H, D)")
    batch, _, heads, key_dim = k.shape
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} must share (B, T, H) with k {tuple(k.shape)}")
    for name, gate in (("log_gamma", log_gamma), ("beta", beta)):
        if gate.shape != k.shape[:3]:
            raise ValueError(f"{name} {tuple(gate.shape)} must be (B, T, H) = {tuple(k.shape[:3])}")
    expected_state = (batch, heads, v.shape[-1], key_dim)
    if initial_state is not None and tuple(initial_state.shape) != expected_state:
        raise ValueError(f"initial_state {tuple(initial_state.shape)} must be (B, H, Dv, Dk) = {expected_state}")
    check_doc_start(doc_start, batch, k.shape[1])


def gated_delta_step_inplace(
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    *,
    normalize_qk: bool = True,
) -> torch.Tensor:
    """One decode step on a state pool, in place via index ops (the CPU path of the decode step).

    state_pool (slots, H, Dv, Dk); slots (B,) integer, distinct; q, k (B, H, Dk); v (B, H, Dv);
    log_gamma, beta (B, H). Rows state_pool[slots] are replaced by the new states; r (B, H, Dv) in
    v's dtype is returned. Arithmetic in the pool's dtype.
    """
    _check_step_shapes(state_pool, slots, q, k, v, log_gamma, beta)
    dtype = state_pool.dtype
    q, k, v_, log_gamma, beta = (x.to(dtype) for x in (q, k, v, log_gamma, beta))
    if normalize_qk:
        q = F.normalize(q, dim=-1, eps=L2_NORM_EPS)
        k = F.normalize(k, dim=-1, eps=L2_NORM_EPS)
    r, new_state = gated_delta_step(state_pool.index_select(0, slots), q, k, v_, log_gamma, beta)
    state_pool.index_copy_(0, slots, new_state)
    return r.to(v.dtype)


def _check_step_shapes(state_pool, slots, q, k, v, log_gamma, beta) -> None:
    if state_pool.dim() != 4:
        raise ValueError(f"state_pool {tuple(state_pool.shape)} must be (slots, H, Dv, Dk)")
    _, heads, value_dim, key_dim = state_pool.shape
    batch = slots.shape[0] if slots.dim() == 1 else -1
    if slots.dim() != 1 or slots.dtype.is_floating_point:
        raise ValueError(f"slots {tuple(slots.shape)} {slots.dtype} must be a 1-d integer tensor (B,)")
    expected = {
        "q": (batch, heads, key_dim),
        "k": (batch, heads, key_dim),
        "v": (batch, heads, value_dim),
        "log_gamma": (batch, heads),
        "beta": (batch, heads),
    }
    for name, x in zip(expected, (q, k, v, log_gamma, beta)):
        if tuple(x.shape) != expected[name]:
            raise ValueError(f"{name} {tuple(x.shape)} must be {expected[name]} for this pool and slots")
