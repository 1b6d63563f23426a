"""Tests for the plain-PyTorch gated delta rule references (docs/model.md section 4)."""

import math

import pytest
import torch
import torch.nn.functional as F
from documents import doc_start_from_lengths
from gated_delta_documents import PACKED_LENGTHS, assert_documents_apart
from helpers import random_inputs

from atma_titan.kernels.documents import document_resets
from atma_titan.kernels.gated_delta.reference import (
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_step,
)

F64 = torch.float64


def run(fn, inputs, **kwargs):
    return fn(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        inputs["log_gamma"],
        inputs["beta"],
        initial_state=inputs["initial_state"],
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------
# The ground truth itself


def test_recurrent_matches_literal_matrix_formula():
    """M_t = gamma M_{t-1} (I - beta k k^T) + beta v k^T with an explicit identity, r_t = M_t q_t."""
    inputs = random_inputs(batch=1, seq_len=9, heads=2, key_dim=4, value_dim=3)
    r, final_state = run(gated_delta_recurrent, inputs)

    q = F.normalize(inputs["q"], dim=-1)
    k = F.normalize(inputs["k"], dim=-1)
    state = inputs["initial_state"].clone()
    eye = torch.eye(4, dtype=F64)
    for t in range(9):
        for h in range(2):
            k_t, gamma, beta = k[0, t, h], inputs["log_gamma"][0, t, h].exp(), inputs["beta"][0, t, h]
            write = beta * torch.outer(inputs["v"][0, t, h], k_t)
            state[0, h] = gamma * state[0, h] @ (eye - beta * torch.outer(k_t, k_t)) + write
            torch.testing.assert_close(r[0, t, h], state[0, h] @ q[0, t, h])
    torch.testing.assert_close(final_state, state)


# ---------------------------------------------------------------------------------------------
# Chunked == recurrent

CHUNK_CASES = [
    # (seq_len, chunk_size)
    (37, 16),  # ragged tail chunk
    (37, 1),  # one token per chunk: the UT system is 1x1
    (37, 2),
    (32, 16),  # exact multiple
    (37, 37),  # one chunk exactly
    (37, 64),  # chunk longer than the sequence
    (1, 16),  # a single token
]


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["init", "zeros"])
@pytest.mark.parametrize("seq_len,chunk_size", CHUNK_CASES)
def test_chunked_matches_recurrent_forward(seq_len, chunk_size, with_initial_state):
    inputs = random_inputs(seq_len=seq_len, with_initial_state=with_initial_state, seed=seq_len)
    r_ref, state_ref = run(gated_delta_recurrent, inputs)
    r, state = run(gated_delta_chunked, inputs, chunk_size=chunk_size)
    torch.testing.assert_close(r, r_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, state_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["init", "zeros"])
@pytest.mark.parametrize("seq_len,chunk_size", [(37, 16), (37, 1), (20, 64), (24, 8)])
def test_chunked_matches_recurrent_gradients(seq_len, chunk_size, with_initial_state):
    inputs = random_inputs(
        seq_len=seq_len, with_initial_state=with_initial_state, requires_grad=True, seed=100 + seq_len
    )
    leaves = {name: x for name, x in inputs.items() if x is not None}
    gen = torch.Generator().manual_seed(7)
    r_weight = torch.randn(2, seq_len, 3, 6, generator=gen, dtype=F64)
    state_weight = torch.randn(2, 3, 6, 8, generator=gen, dtype=F64)

    def grads(fn, **kwargs):
        r, state = run(fn, inputs, **kwargs)
        loss = (r * r_weight).sum() + (state * state_weight).sum()
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    expected = grads(gated_delta_recurrent)
    actual = grads(gated_delta_chunked, chunk_size=chunk_size)
    for name in leaves:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-9, atol=1e-9, msg=name)


def test_chunked_passes_gradcheck():
    """Autograd through the triangular solve against finite differences (tiny shapes)."""
    inputs = random_inputs(batch=1, seq_len=5, heads=1, key_dim=3, value_dim=2, requires_grad=True, seed=3)
    args = [inputs[name] for name in ("q", "k", "v", "log_gamma", "beta", "initial_state")]

    def fn(q, k, v, log_gamma, beta, initial_state):
        return gated_delta_chunked(q, k, v, log_gamma, beta, initial_state=initial_state, chunk_size=2)

    assert torch.autograd.gradcheck(fn, args)


def test_splitting_the_sequence_hands_off_state():
    """Running [0, 20) then [20, 37) from the returned state equals one run over [0, 37)."""
    inputs = random_inputs(seed=11)
    first = {n: x if x is None or n == "initial_state" else x[:, :20] for n, x in inputs.items()}
    second = {n: x if x is None else x[:, 20:] for n, x in inputs.items()}
    for fn, kwargs in ((gated_delta_recurrent, {}), (gated_delta_chunked, {"chunk_size": 8})):
        r_full, state_full = run(fn, inputs, **kwargs)
        r_a, state_a = run(fn, first, **kwargs)
        r_b, state_b = run(fn, {**second, "initial_state": state_a}, **kwargs)
        torch.testing.assert_close(torch.cat([r_a, r_b], dim=1), r_full)
        torch.testing.assert_close(state_b, state_full)


def test_extreme_gates_stay_finite_and_agree_in_float32():
    """gamma down to e^-30 (cumulative decays underflow inside a chunk), beta near 0 and 1."""
    inputs = random_inputs(seq_len=100, dtype=torch.float32, seed=5, requires_grad=False)
    gen = torch.Generator().manual_seed(5)
    inputs["log_gamma"] = -30.0 * torch.rand(2, 100, 3, generator=gen) ** 4
    inputs["beta"] = torch.where(torch.rand(2, 100, 3, generator=gen) < 0.5, 1e-4, 1 - 1e-4)
    for x in inputs.values():
        x.requires_grad_(True)

    r_ref, state_ref = run(gated_delta_recurrent, inputs)
    r, state = run(gated_delta_chunked, inputs, chunk_size=64)
    torch.testing.assert_close(r, r_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, state_ref, rtol=1e-4, atol=1e-4)
    grads = torch.autograd.grad(r.sum() + state.sum(), list(inputs.values()))
    assert all(torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------------------------------------
# Conventions


def test_normalize_qk_makes_q_and_k_scale_free():
    inputs = random_inputs(seed=21)
    scaled = {**inputs, "q": inputs["q"] * 7.0, "k": inputs["k"] * 0.01}
    unit = {**inputs, "q": F.normalize(inputs["q"], dim=-1), "k": F.normalize(inputs["k"], dim=-1)}
    for fn in (gated_delta_recurrent, gated_delta_chunked):
        r, state = run(fn, inputs)
        r_scaled, state_scaled = run(fn, scaled)
        r_unit, state_unit = run(fn, unit, normalize_qk=False)
        torch.testing.assert_close(r_scaled, r)
        torch.testing.assert_close(state_scaled, state)
        torch.testing.assert_close(r_unit, r)
        torch.testing.assert_close(state_unit, state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_compute_in_float32(dtype):
    """Smoke test: half inputs give r in the input dtype, a float32 state, and values close to a
    float64 run on the same (already rounded) inputs."""
    inputs = random_inputs(seq_len=45, dtype=dtype, seed=31)
    as_f64 = {n: x.to(F64) for n, x in inputs.items()}
    r_ref, state_ref = run(gated_delta_recurrent, as_f64)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for fn, kwargs in ((gated_delta_recurrent, {}), (gated_delta_chunked, {"chunk_size": 16})):
        r, state = run(fn, inputs, **kwargs)
        assert r.dtype == dtype and r.shape == (2, 45, 3, 6)
        assert state.dtype == torch.float32 and state.shape == (2, 3, 6, 8)
        torch.testing.assert_close(r.to(F64), r_ref, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(state.to(F64), state_ref, rtol=1e-4, atol=1e-4)


def test_float64_inputs_keep_float64_state():
    inputs = random_inputs(seq_len=4, with_initial_state=False)
    for fn in (gated_delta_recurrent, gated_delta_chunked):
        r, state = run(fn, inputs)
        assert r.dtype == F64 and state.dtype == F64


def test_empty_sequence_returns_initial_state():
    inputs = random_inputs(seq_len=0, seed=2)
    for fn in (gated_delta_recurrent, gated_delta_chunked):
        r, state = run(fn, inputs)
        assert r.shape == (2, 0, 3, 6)
        torch.testing.assert_close(state, inputs["initial_state"])


def test_rejects_bad_shapes_and_chunk_size():
    inputs = random_inputs(seq_len=4)
    with pytest.raises(ValueError, match="beta"):
        run(gated_delta_chunked, {**inputs, "beta": inputs["beta"][:, :3]})
    with pytest.raises(ValueError, match="initial_state"):
        run(gated_delta_recurrent, {**inputs, "initial_state": inputs["initial_state"].mT})
    with pytest.raises(ValueError, match="chunk_size"):
        run(gated_delta_chunked, inputs, chunk_size=0)


# ---------------------------------------------------------------------------------------------
# Documents: the state is zeroed before each document start (doc_start)


def chunked(chunk_size):
    def run_chunked(*args, **kwargs):
        return gated_delta_chunked(*args, chunk_size=chunk_size, **kwargs)

    return run_chunked


DOCUMENT_RUNS = {
    "recurrent": gated_delta_recurrent,
    # chunks of 8 and 4 put the reset at 8 on a chunk start; 5 and 3 put every reset inside a chunk and
    # leave a ragged tail; 1 makes every reset a chunk start; 64 holds all of them in one chunk
    **{f"chunked{size}": chunked(size) for size in (1, 3, 4, 5, 8, 64)},
}


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["init", "zeros"])
@pytest.mark.parametrize("run_name", DOCUMENT_RUNS)
def test_packed_documents_match_each_document_alone(run_name, with_initial_state):
    inputs = random_inputs(batch=3, seq_len=24, with_initial_state=with_initial_state, seed=40 + len(run_name))
    doc_start = doc_start_from_lengths(PACKED_LENGTHS)
    assert_documents_apart(DOCUMENT_RUNS[run_name], inputs, doc_start, tol=1e-10)


@pytest.mark.parametrize("run_name", ["recurrent", "chunked5", "chunked8"])
def test_reset_positions_get_no_log_gamma_gradient(run_name):
    inputs = random_inputs(batch=3, seq_len=24, requires_grad=True, seed=50)
    doc_start = doc_start_from_lengths(PACKED_LENGTHS)
    r, state = run(DOCUMENT_RUNS[run_name], inputs, doc_start=doc_start)
    (dlog_gamma,) = torch.autograd.grad(r.square().sum() + state.sum(), inputs["log_gamma"])
    resets = document_resets(doc_start)
    assert torch.equal(dlog_gamma[resets], torch.zeros_like(dlog_gamma[resets]))  # exactly, not nearly
    assert (dlog_gamma[~resets] != 0).all()


@pytest.mark.parametrize("run_name", ["recurrent", "chunked5"])
def test_one_document_window_is_the_plain_run(run_name):
    """doc_start all zero (one document, continuing the initial state) gives exactly the doc_start=None numbers."""
    inputs = random_inputs(seq_len=13, requires_grad=True, seed=51)
    leaves = list(inputs.values())
    results = []
    for doc_start in (None, torch.zeros(2, 13, dtype=torch.int32)):
        r, state = run(DOCUMENT_RUNS[run_name], inputs, doc_start=doc_start)
        grads = torch.autograd.grad((r * r.detach().cos()).sum() + state.square().sum(), leaves)
        results.append((r, state, *grads))
    for plain, one_document in zip(*results):
        assert torch.equal(plain, one_document)


def test_chunked_with_documents_passes_gradcheck():
    inputs = random_inputs(batch=1, seq_len=7, heads=1, key_dim=3, value_dim=2, requires_grad=True, seed=52)
    args = [inputs[name] for name in ("q", "k", "v", "log_gamma", "beta", "initial_state")]
    doc_start = doc_start_from_lengths([[1, 3, 1, 2]])  # resets at 1, 4 and 5: starts and middles of chunks of 3

    def fn(q, k, v, log_gamma, beta, initial_state):
        kwargs = {"initial_state": initial_state, "doc_start": doc_start, "chunk_size": 3}
        return gated_delta_chunked(q, k, v, log_gamma, beta, **kwargs)

    assert torch.autograd.gradcheck(fn, args)


def test_int64_doc_start_is_accepted():
    inputs = random_inputs(batch=3, seq_len=24, seed=53)
    doc_start = doc_start_from_lengths(PACKED_LENGTHS)
    for fn in (gated_delta_recurrent, gated_delta_chunked):
        r32, state32 = run(fn, inputs, doc_start=doc_start)
        r64, state64 = run(fn, inputs, doc_start=doc_start.long())
        assert torch.equal(r32, r64) and torch.equal(state32, state64)


def test_rejects_bad_doc_start():
    inputs = random_inputs(seq_len=6)
    for fn in (gated_delta_recurrent, gated_delta_chunked):
        with pytest.raises(ValueError, match="doc_start"):
            run(fn, inputs, doc_start=torch.zeros(2, 7, dtype=torch.int32))
        with pytest.raises(ValueError, match="doc_start"):
            run(fn, inputs, doc_start=torch.zeros(6, dtype=torch.int32))
        with pytest.raises(ValueError, match="doc_start"):
            run(fn, inputs, doc_start=torch.zeros(2, 6))


# ---------------------------------------------------------------------------------------------
# Stability: why ATMA L2-normalises the keys
#
# With ||k|| = 1 and beta in (0, 1), ||I - beta k k^T||_2 = 1, so
#     ||M_t||_2 <= gamma_t ||M_{t-1}||_2 + beta_t ||v_t||_2.
# With gamma_t <= gamma_max < 1 the fixed point of a -> gamma_max a + beta_max v_max bounds every
# step:  ||M_t||_2 <= max(||M_0||_2, beta_max v_max / (1 - gamma_max)),  independent of t.
# At gamma = 1 there is no t-independent bound for adversarial keys (keys kept orthogonal to the
# state add ||v||^2 of energy per step), but the growth is at most additive: per row m of M, only
# the component a = m.k changes, to (1 - beta) a + beta v_i, which adds at most beta/(2-beta) v_i^2,
#     ||M_t||_F^2 <= ||M_{t-1}||_F^2 + beta_t / (2 - beta_t) ||v_t||^2,
# and the homogeneous part never expands, so two states fed the same tokens never move apart.
# With RMS-normalised keys (||k||^2 = Dk) the eigenvalue 1 - beta Dk along k is < -1 whenever
# beta > 2 / Dk, and the state grows geometrically.

STEPS = 10_000
BATCH, HEADS, KEY_DIM, VALUE_DIM = 4, 2, 16, 4
GAMMA_MAX = 0.995


def stability_stream(seed, gamma_max=GAMMA_MAX, gamma_is_one=False):
    """Per-step (k, v, log_gamma, beta) for STEPS tokens with unit-norm keys, and a start state."""
    gen = torch.Generator().manual_seed(seed)
    shape = (STEPS, BATCH, HEADS)
    k = F.normalize(torch.randn(*shape, KEY_DIM, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(*shape, VALUE_DIM, generator=gen, dtype=F64)
    gamma = 0.5 + (gamma_max - 0.5) * torch.rand(*shape, generator=gen, dtype=F64)
    if gamma_is_one:
        gamma = torch.ones_like(gamma)
    beta = torch.rand(*shape, generator=gen, dtype=F64).clamp(1e-3, 1 - 1e-3)
    initial_state = 3.0 * torch.randn(BATCH, HEADS, VALUE_DIM, KEY_DIM, generator=gen, dtype=F64)
    return k, v, gamma.log(), beta, initial_state


def state_trajectory(initial_state, k, v, log_gamma, beta, stop_above=math.inf):
    """States M_0 .. M_T stacked on dim 0; stops early once a spectral norm exceeds stop_above."""
    states = [initial_state]
    for t in range(k.shape[0]):
        _, state = gated_delta_step(states[-1], k[t], k[t], v[t], log_gamma[t], beta[t])
        states.append(state)
        if t % 64 == 0 and not (torch.linalg.matrix_norm(state, ord=2) <= stop_above).all():
            break
    return torch.stack(states)


def spectral_bound(initial_state, v, beta, gamma_max):
    v_max = torch.linalg.vector_norm(v, dim=-1).max()
    start = torch.linalg.matrix_norm(initial_state, ord=2).max()
    return torch.maximum(start, beta.max() * v_max / (1 - gamma_max)).item()


def test_unit_norm_keys_keep_state_bounded_for_10k_steps():
    k, v, log_gamma, beta, initial_state = stability_stream(seed=0)
    norms = torch.linalg.matrix_norm(state_trajectory(initial_state, k, v, log_gamma, beta), ord=2)
    assert norms.shape[0] == STEPS + 1

    # the per-step contraction inequality holds at every step ...
    v_norms = torch.linalg.vector_norm(v, dim=-1)
    assert (norms[1:] <= log_gamma.exp() * norms[:-1] + beta * v_norms + 1e-9).all()
    # ... hence the t-independent bound (a t-dependent one, ||M_0|| + t beta v, would be useless)
    assert norms.max() <= spectral_bound(initial_state, v, beta, GAMMA_MAX)


def test_unit_norm_keys_at_gamma_one_grow_at_most_additively():
    k, v, log_gamma, beta, initial_state = stability_stream(seed=1, gamma_is_one=True)
    energy = torch.linalg.matrix_norm(state_trajectory(initial_state, k, v, log_gamma, beta)) ** 2
    v_energy = torch.linalg.vector_norm(v, dim=-1) ** 2
    assert (energy[1:] <= energy[:-1] + beta / (2 - beta) * v_energy + 1e-9).all()

    # the homogeneous part gamma * D (I - beta k k^T) never expands the gap between two states
    gap = torch.randn(initial_state.shape, dtype=F64, generator=torch.Generator().manual_seed(9))
    gaps = torch.linalg.matrix_norm(state_trajectory(gap, k, torch.zeros_like(v), log_gamma, beta), ord=2)
    assert (gaps[1:] <= gaps[:-1] + 1e-12 * gaps[0]).all()


def test_rms_normalised_keys_blow_up_the_state():
    """Same stream with ||k||^2 = Dk (ATMA's attention normalisation): the bound breaks."""
    k, v, log_gamma, beta, initial_state = stability_stream(seed=0)
    bound = spectral_bound(initial_state, v, beta, GAMMA_MAX)
    states = state_trajectory(initial_state, k * math.sqrt(KEY_DIM), v, log_gamma, beta, stop_above=1e6 * bound)
    assert states.shape[0] < STEPS + 1, "expected divergence well before the end of the stream"
    assert not (torch.linalg.matrix_norm(states, ord=2).max() <= 1e6 * bound)
