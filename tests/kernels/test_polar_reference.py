"""Polar attention references: the streaming autograd.Function against the materialised formula.

Ground truth is `polar_attention_naive` in float64 with autograd; the naive form itself is checked
against a literal per-query transcription of docs/model.md section 3 so shared convention mistakes
(offsets, windows, GQA head mapping) cannot hide.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import PARAM_NAMES, grads_of, make_inputs, random_cotangents
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from atma_titan.kernels.polar.reference import (
    polar_attention_naive,
    polar_attention_reference,
    polar_scalars,
    visible_key_counts,
)


def assert_close_named(actual, expected, names, **tol):
    for name, a, e in zip(names, actual, expected):
        torch.testing.assert_close(a, e, msg=lambda m, n=name: f"{n}: {m}", **tol)


# shapes: (B, Tq, Tk, H, Hkv, D, window, block_q, block_k)
CASES = {
    "causal_mha": (2, 24, 24, 2, 2, 8, 0, 8, 8),
    "causal_gqa4_ragged": (2, 29, 29, 4, 1, 8, 0, 8, 6),
    "window_gqa4_ragged": (1, 37, 37, 4, 1, 8, 5, 16, 4),
    "window_larger_than_block": (2, 31, 31, 2, 2, 4, 13, 8, 8),
    "offset_queries": (2, 11, 40, 4, 2, 8, 0, 4, 16),
    "offset_queries_window": (1, 17, 50, 4, 1, 8, 9, 5, 7),
    "single_tile": (1, 9, 9, 2, 1, 8, 0, 128, 128),
    "block_of_one": (1, 6, 8, 2, 2, 4, 3, 1, 1),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_matches_naive(case):
    b, tq, tk, h, hkv, d, window, bq, bk = case
    inputs = make_inputs(b, tq, tk, h, hkv, d, requires_grad=False)
    c_ref, mag_ref = polar_attention_naive(*inputs, window=window)
    c, mag = polar_attention_reference(*inputs, window=window, block_q=bq, block_k=bk)
    assert c.shape == (b, tq, h, d) and mag.shape == (b, tq, h)
    assert c.dtype == mag.dtype == torch.float64
    torch.testing.assert_close(c, c_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mag, mag_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gradients_match_naive(case):
    b, tq, tk, h, hkv, d, window, bq, bk = case
    inputs = make_inputs(b, tq, tk, h, hkv, d, seed=2)
    g_c, g_mag = random_cotangents(*polar_attention_naive(*inputs, window=window))
    expected = grads_of(polar_attention_naive, inputs, g_c, g_mag, window=window)
    actual = grads_of(polar_attention_reference, inputs, g_c, g_mag, window=window, block_q=bq, block_k=bk)
    assert_close_named(actual, expected, PARAM_NAMES, rtol=1e-9, atol=1e-11)


def test_gradient_of_mag_alone_and_c_alone():
    """Each output's backward path on its own (the other cotangent is materialised as zeros)."""
    inputs = make_inputs(1, 10, 10, 2, 1, 4, seed=3)
    for pick in (0, 1):
        expected = torch.autograd.grad(
            polar_attention_naive(*inputs)[pick].sum(), inputs, allow_unused=True, materialize_grads=True
        )  # c ignores mag_beta
        actual = torch.autograd.grad(polar_attention_reference(*inputs, block_q=4, block_k=3)[pick].sum(), inputs)
        assert_close_named(actual, expected, PARAM_NAMES, rtol=1e-9, atol=1e-11)


def literal_polar(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window):
    """docs/model.md section 3 transcribed one query at a time, with explicit positions and head mapping."""
    b_sz, tq, h_sz, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    c = torch.zeros_like(q)
    mag = torch.zeros(b_sz, tq, h_sz, dtype=q.dtype)
    for b in range(b_sz):
        for h in range(h_sz):
            kv = h // (h_sz // hkv)
            for i in range(tq):
                pos = tk - tq + i
                keys = [j for j in range(pos + 1) if window == 0 or j > pos - window]
                n = len(keys)
                temp = 1 + F.softplus(len_gain[h]) * math.log(n)
                null = null_base[h] + F.softplus(null_slope[h]) * math.sqrt(math.log(n + 1))
                s = torch.stack([q[b, i, h] @ k[b, j, kv] / math.sqrt(d) for j in keys])
                w = torch.softmax(torch.cat([temp * s, (temp * null).reshape(1)]), dim=0)
                s_vec = sum(w[t] * v[b, j, kv] for t, j in enumerate(keys)) + w[-1] * v_null[h]
                c[b, i, h] = s_vec / max(s_vec.norm(), torch.tensor(1e-6, dtype=q.dtype))
                n_eff = 1 / ((w[:-1] / (1 - w[-1])) ** 2).sum()
                m_eff = n_eff * (1 - w[-1])
                mag[b, i, h] = torch.tanh(F.softplus(mag_beta[h]) * torch.log(1 + m_eff))
    return c, mag


@pytest.mark.parametrize("window", [0, 4])
def test_naive_matches_literal_transcription(window):
    inputs = make_inputs(2, 7, 12, 4, 2, 4, seed=4, requires_grad=False)
    c_lit, mag_lit = literal_polar(*inputs, window)
    c_ref, mag_ref = polar_attention_naive(*inputs, window=window)
    torch.testing.assert_close(c_ref, c_lit, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mag_ref, mag_lit, rtol=1e-10, atol=1e-12)


def test_first_query_sees_one_key():
    """n = 1: temp = 1, null = b + softplus(gamma) sqrt(ln 2), m_eff = w_1 (one key, n_eff = 1)."""
    inputs = make_inputs(1, 1, 1, 2, 1, 4, seed=5, requires_grad=False)
    q, k, v, len_gain, null_base, null_slope, mag_beta, v_null = inputs
    c, mag = polar_attention_reference(*inputs)
    s = (q[0, 0] * k[0, 0, 0]).sum(-1) / 2.0  # (H,)
    null = null_base + F.softplus(null_slope) * math.sqrt(math.log(2.0))
    w1 = torch.sigmoid(s - null)
    s_vec = w1[:, None] * v[0, 0, 0] + (1 - w1)[:, None] * v_null
    torch.testing.assert_close(c[0, 0], s_vec / s_vec.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(mag[0, 0], torch.tanh(F.softplus(mag_beta) * torch.log1p(w1)))
    # len_gain is multiplied by ln(1) = 0 for the one query: its gradient must be exactly zero
    inputs = make_inputs(1, 1, 1, 2, 1, 4, seed=5)
    c, mag = polar_attention_reference(*inputs)
    (g_len_gain,) = torch.autograd.grad(c.sum() + mag.sum(), inputs[3])
    assert torch.equal(g_len_gain, torch.zeros_like(g_len_gain))


def test_clamped_direction_norm():
    """||s_vec|| below 1e-6: c = s_vec / 1e-6, and g_s.s_vec no longer vanishes in the backward."""
    inputs = make_inputs(1, 9, 9, 2, 1, 4, seed=6)
    with torch.no_grad():
        inputs[2].mul_(1e-8)
        inputs[7].mul_(1e-8)
    c_ref, mag_ref = polar_attention_naive(*inputs)
    assert c_ref.norm(dim=-1).max() < 0.5  # really in the clamped regime
    c, mag = polar_attention_reference(*inputs, block_q=4, block_k=4)
    torch.testing.assert_close(c, c_ref, rtol=1e-9, atol=1e-12)
    g_c, g_mag = random_cotangents(c_ref, mag_ref)
    expected = grads_of(polar_attention_naive, inputs, g_c, g_mag)
    actual = grads_of(polar_attention_reference, inputs, g_c, g_mag, block_q=4, block_k=4)
    assert_close_named(actual, expected, PARAM_NAMES, rtol=1e-8, atol=1e-10)


def test_dominant_null_stays_finite_in_float32():
    """A null logit ~150 above every key would overflow e^(a_N - m) in float32; the fold must not."""
    inputs = make_inputs(1, 40, 40, 2, 1, 8, seed=7)
    with torch.no_grad():
        inputs[3].fill_(1.0)  # len_gain: temp ~ 1 + 1.31 ln n
        inputs[4].fill_(40.0)  # null_base
    inputs32 = [x.detach().float().requires_grad_() for x in inputs]
    c_ref, mag_ref = polar_attention_naive(*inputs)
    c, mag = polar_attention_reference(*inputs32, block_q=16, block_k=16)
    assert torch.isfinite(c).all() and torch.isfinite(mag).all()
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mag.double(), mag_ref, rtol=1e-4, atol=1e-30)
    grads = torch.autograd.grad(c.sum() + mag.sum(), inputs32)
    assert all(torch.isfinite(g).all() for g in grads)


def test_gradcheck_tiny():
    inputs = make_inputs(1, 5, 6, 2, 1, 3, seed=8)
    assert torch.autograd.gradcheck(
        lambda *x: polar_attention_reference(*x, window=4, block_q=2, block_k=3), inputs, eps=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_close_to_float64(dtype):
    inputs64 = make_inputs(2, 33, 33, 4, 1, 16, seed=9)
    inputs = [x.detach().to(dtype).requires_grad_() for x in inputs64]
    # compare against float64 on the rounded inputs so only the kernel's arithmetic is measured
    rounded64 = [x.detach().double().requires_grad_() for x in inputs]
    c, mag = polar_attention_reference(*inputs, window=20, block_q=16, block_k=8)
    c_ref, mag_ref = polar_attention_naive(*rounded64, window=20)
    assert c.dtype == mag.dtype == dtype
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=3e-3, atol=3e-3)
    torch.testing.assert_close(c.double(), c_ref, **tol)
    torch.testing.assert_close(mag.double(), mag_ref, **tol)

    g_c, g_mag = random_cotangents(c_ref, mag_ref)
    actual = grads_of(
        polar_attention_reference, inputs, g_c.to(dtype), g_mag.to(dtype), window=20, block_q=16, block_k=8
    )
    expected = grads_of(polar_attention_naive, rounded64, g_c, g_mag, window=20)
    for name, a, e in zip(PARAM_NAMES, actual, expected):
        assert a.dtype == dtype, name
        scale = e.abs().max().item()
        err = (a.double() - e).abs().max().item()
        assert err <= 0.03 * scale + 1e-3, f"{name}: max error {err} vs scale {scale}"


def test_bfloat16_head_scalar_gradients():
    """The per-head scalars' gradients in bf16 at a shape where d len_gain is a small residual.

    d len_gain = sum_i d temp_i ln(n_i) sigmoid(len_gain) nearly cancels. With delta = g_s.s_vec taken
    from c (saved in bf16) the error was 25% of its scale here; delta recomputed from the sweep's own
    products leaves ~1.6%. The cotangents are rounded to bf16 on both sides: autograd hands the
    backward bf16 cotangents anyway, and their rounding alone moves d len_gain by ~5% of its scale.
    """
    inputs64 = make_inputs(2, 300, 300, 4, 4, 64, seed=21)
    inputs = [x.detach().to(torch.bfloat16).requires_grad_() for x in inputs64]
    rounded64 = [x.detach().double().requires_grad_() for x in inputs]
    c_ref, mag_ref = polar_attention_naive(*rounded64)
    g_c, g_mag = (g.to(torch.bfloat16) for g in random_cotangents(c_ref, mag_ref))
    actual = grads_of(polar_attention_reference, inputs, g_c, g_mag, block_q=64, block_k=64)
    expected = grads_of(polar_attention_naive, rounded64, g_c.double(), g_mag.double())
    for name, a, e in zip(PARAM_NAMES[3:], actual[3:], expected[3:]):
        scale = e.abs().max().item()
        err = (a.double() - e).abs().max().item()
        assert err <= 0.03 * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


def test_polar_scalars_at_init():
    n = torch.tensor([1.0, 2048.0])
    temp, null = polar_scalars(n[:, None], torch.full((3,), -1.0), torch.full((3,), 2.0), torch.full((3,), 0.5))
    assert temp.shape == null.shape == (2, 3)
    sp_alpha, sp_gamma = math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.5))
    torch.testing.assert_close(temp[:, 0], torch.tensor([1.0, 1 + sp_alpha * math.log(2048.0)]))
    torch.testing.assert_close(
        null[:, 0], torch.tensor([2 + sp_gamma * math.sqrt(math.log(2.0)), 2 + sp_gamma * math.sqrt(math.log(2049.0))])
    )
    assert visible_key_counts(3, 5).tolist() == [3, 4, 5]
    assert visible_key_counts(4, 4, window=2).tolist() == [1, 2, 2, 2]


def test_rejects_bad_shapes():
    inputs = make_inputs(1, 4, 4, 3, 2, 4, requires_grad=False)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError):
        polar_attention_reference(*inputs)
    inputs = make_inputs(1, 5, 4, 2, 1, 4, requires_grad=False)  # more queries than keys
    with pytest.raises(ValueError):
        polar_attention_reference(*inputs)


class LargestTensorProbe(TorchDispatchMode):
    """Records the largest tensor any aten op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_probe_sees_materialised_scores():
    """The probe used below must be able to fail: it catches the naive form's Tq x Tk weights."""
    inputs = make_inputs(1, 256, 256, 2, 1, 16, requires_grad=False)
    with torch.no_grad(), LargestTensorProbe() as probe:
        polar_attention_naive(*inputs)
    assert probe.largest >= 256 * 256


@pytest.mark.parametrize("window", [0, 1000])
def test_long_sequence_streams_in_tiles(window):
    b, t, h, hkv, d, block = 1, 8192, 2, 1, 16, 512
    inputs = make_inputs(b, t, t, h, hkv, d, dtype=torch.float32, seed=10, requires_grad=False)
    with torch.no_grad(), LargestTensorProbe() as probe:
        c, mag = polar_attention_reference(*inputs, window=window, block_q=block, block_k=block)
    assert torch.isfinite(c).all() and torch.isfinite(mag).all()
    # nothing bigger than the inputs or one score tile per (batch, head); a T x T tensor is 67M
    assert probe.largest <= max(b * t * h * d, b * h * block * block), probe.largest

    # the last queries through the naive form: Tq < Tk keeps its weights at 64 x T
    tail = 64
    tail_inputs = [inputs[0][:, -tail:].double(), *(x.double() for x in inputs[1:])]
    c_ref, mag_ref = polar_attention_naive(*tail_inputs, window=window)
    torch.testing.assert_close(c[:, -tail:].double(), c_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mag[:, -tail:].double(), mag_ref, rtol=1e-4, atol=1e-5)
