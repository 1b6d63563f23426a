"""Triton kernel for one in-place decode step of the gated delta rule on a state pool.

    M <- gamma M (I - beta k k^T) + beta v k^T = gamma M + beta (v - gamma M k) k^T,   r = M q

Each program owns BV rows of one (slot, head) state: it reads them once, forms (M k) for its rows,
updates, writes them back in place and reads r for its rows from the new rows. Nothing is
allocated but r, nothing is copied and nothing waits on the host, so the step can be captured in a
CUDA graph (fixed addresses: the pool, the slot table and the token buffers).
Two sequences must not share a slot in one step (their programs would race on the same rows).

Only the kernel and its launcher live here; the torch.library op `atma::gated_delta_step` (with its
PyTorch fallback on CPU) is in ops.py. Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atma_titan.kernels.gated_delta.triton_chunked import _contiguous, _normalize_rows

# Rows of M per program and warps. Memory-bound: each program streams ROWS x Dk fp32 once in and once
# out (16-byte vector loads / stores). At B64 H8 128x128, 32 rows give B*H*Dv/32 = 2048 programs of
# 16 KiB in + 16 KiB out. Compiled for sm_90 (benchmarks/kernels/gated_delta.py --resources): 32 rows x 8
# warps take 48 registers a thread, so 8 blocks (2048 threads) stay resident per SM: 128 KiB of
# loads in flight per SM and about 2 waves over the H200's 132 SMs. 32 x 4 warps take 128 registers
# (4 blocks, 64 KiB in flight); 16 x 4 matches 32 x 8 in flight but repeats the q / k normalisation
# on twice the programs; 64 x 8 takes 80 registers (3 blocks, 96 KiB). `benchmarks/kernels/gated_delta.py
# --step-sweep` times them in a CUDA graph; both are read at launch, so a caller may retune them.
ROWS_PER_PROGRAM = 32
NUM_WARPS = 8


@triton.jit
def _step_kernel(
    pool_ptr,
    slots_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    log_gamma_ptr,
    beta_ptr,
    r_ptr,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    bh, vb = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    k_cols, v_rows = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    k_in, v_in = k_cols < DK, v_rows < DV

    # The state rows first: the one long (HBM) load of the program is issued before the token's
    # small loads and the normalisation, which then overlap with it. M is read once (fp32, each row
    # Dk contiguous floats), updated in registers and written back once.
    slot = tl.load(slots_ptr + b).to(tl.int64)
    rows = pool_ptr + ((slot * H + h) * DV + v_rows[:, None]) * DK + k_cols[None, :]
    mask = v_in[:, None] & k_in[None, :]
    state = tl.load(rows, mask=mask, other=0.0, eviction_policy="evict_first")

    token = bh.to(tl.int64)
    q = tl.load(q_ptr + token * DK + k_cols[None, :], mask=k_in[None, :], other=0.0).to(tl.float32)
    k = tl.load(k_ptr + token * DK + k_cols[None, :], mask=k_in[None, :], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + token * DV + v_rows, mask=v_in, other=0.0).to(tl.float32)
    gamma = tl.exp(tl.load(log_gamma_ptr + token).to(tl.float32))
    beta = tl.load(beta_ptr + token).to(tl.float32)
    q, _, _ = _normalize_rows(q, NORMALIZE)  # (1, BK), in the kernel: no separate normalisation launch
    k, _, _ = _normalize_rows(k, NORMALIZE)

    state_k = tl.sum(state * k, axis=1)  # (M k) for these rows
    state = gamma * state + (beta * (v - gamma * state_k))[:, None] * k
    tl.store(rows, state, mask=mask)
    r = tl.sum(state * q, axis=1)  # r = M_new q for these rows
    tl.store(r_ptr + token * DV + v_rows, r.to(r_ptr.dtype.element_ty), mask=v_in)


def step_inplace(state_pool, slots, q, k, v, log_gamma, beta, normalize_qk: bool = True) -> torch.Tensor:
    """Launch _step_kernel; state_pool (slots, H, Dv, Dk) fp32 is updated in place, r (B, H, Dv) returned.

    The hot path allocates r and launches one kernel: no copies of the pool (it must already be
    contiguous fp32), no normalisation launches, no host synchronisation."""
    if state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        raise ValueError("state_pool must be a contiguous float32 tensor (it is updated in place)")
    q, k, v, log_gamma, beta, slots = _contiguous(q, k, v, log_gamma, beta, slots)
    batch, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    r = torch.empty_like(v)
    rows = min(ROWS_PER_PROGRAM, max(16, triton.next_power_of_2(value_dim)))
    _step_kernel[(batch * heads, triton.cdiv(value_dim, rows))](
        state_pool, slots, q, k, v, log_gamma, beta, r,
        H=heads, DK=key_dim, DV=value_dim, BK=max(16, triton.next_power_of_2(key_dim)), BV=rows,
        NORMALIZE=normalize_qk, num_warps=NUM_WARPS,
    )  # fmt: skip
    return r
