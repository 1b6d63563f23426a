"""Fused Polar attention Triton kernel under the Triton interpreter (CPU), against float64 ground truth.

Run by test_polar_triton.py (alone: see this folder's conftest.py). The interpreter uses 16 x 16 tiles, so
T = 40..70 covers several key and query tiles, ragged tails, fully visible tiles (no mask) and, with a window,
tiles skipped before it. Every check compares to `polar_attention_naive` in float64, never to the kernel
itself.
"""

from __future__ import annotations

import pytest
import torch
from helpers import PARAM_NAMES, grads_of, make_inputs, random_cotangents

from atma_titan.kernels import backends
from atma_titan.kernels.polar import polar_attention_triton
from atma_titan.kernels.polar.reference import polar_attention_naive

# (B, Tq, Tk, H, Hkv, D, window)
CASES = {
    "causal_mha": (2, 40, 40, 2, 2, 16, 0),
    "causal_gqa4_ragged": (1, 45, 45, 4, 1, 16, 0),
    "window_below_tile_gqa4": (1, 53, 53, 4, 1, 16, 7),
    "window_above_tile": (1, 50, 50, 2, 2, 16, 21),
    "offset_queries": (2, 11, 50, 4, 2, 16, 0),
    "offset_queries_window": (1, 19, 70, 4, 1, 32, 9),
    "single_query": (1, 1, 1, 2, 1, 16, 0),
}


def rounded(inputs, dtype):
    """The inputs in `dtype` (kernel side) and the same rounded values in float64 (ground truth side)."""
    low = [x.detach().to(dtype).requires_grad_() for x in inputs]
    return low, [x.detach().double().requires_grad_() for x in low]


def assert_grads_close(actual, expected, rel, abs_floor, names=PARAM_NAMES):
    """Max error of each gradient against its float64 counterpart, relative to that gradient's scale."""
    for name, a, e in zip(names, actual, expected):
        assert torch.isfinite(a).all(), name
        scale = e.abs().max().item()
        err = (a.double() - e).abs().max().item()
        assert err <= rel * scale + abs_floor, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_float32_forward_and_gradients(case):
    b, tq, tk, h, hkv, d, window = case
    inputs32, inputs64 = rounded(make_inputs(b, tq, tk, h, hkv, d, seed=11), torch.float32)
    c, mag = polar_attention_triton(*inputs32, window=window)
    c_ref, mag_ref = polar_attention_naive(*inputs64, window=window)
    assert c.shape == (b, tq, h, d) and mag.shape == (b, tq, h)
    assert c.dtype == mag.dtype == torch.float32
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(mag.double(), mag_ref, rtol=1e-4, atol=2e-5)

    g_c, g_mag = random_cotangents(c_ref, mag_ref)
    expected = grads_of(polar_attention_naive, inputs64, g_c, g_mag, window=window)
    actual = grads_of(polar_attention_triton, inputs32, g_c.float(), g_mag.float(), window=window)
    for a, x in zip(actual, inputs32):
        assert a.dtype == x.dtype and a.shape == x.shape
    assert_grads_close(actual, expected, rel=1e-4, abs_floor=1e-5)


@pytest.mark.parametrize("case", ["causal_mha", "window_above_tile", "offset_queries", "window_below_tile_gqa4"])
def test_tiles_through_tensor_descriptors(case, monkeypatch):
    """Hopper's kernels take the tiles they loop over by tensor descriptor (K and V in the forward and the dq
    sweep, q and g_acc in the dk/dv sweep; rows past the end arrive as zeros): the same answers and gradients
    as the float64 form."""
    from atma_titan.kernels.polar import triton_attention as tk

    monkeypatch.setattr(tk, "copy_engine", lambda device: True)
    test_float32_forward_and_gradients(CASES[case])


@pytest.mark.parametrize("case", ["causal_gqa4_ragged", "offset_queries_window"])
def test_float16_close_to_float64(case):
    b, tq, tk, h, hkv, d, window = CASES[case]
    inputs16, inputs64 = rounded(make_inputs(b, tq, tk, h, hkv, d, seed=12), torch.float16)
    c, mag = polar_attention_triton(*inputs16, window=window)
    c_ref, mag_ref = polar_attention_naive(*inputs64, window=window)
    assert c.dtype == mag.dtype == torch.float16
    torch.testing.assert_close(c.double(), c_ref, rtol=3e-3, atol=3e-3)
    torch.testing.assert_close(mag.double(), mag_ref, rtol=3e-3, atol=3e-3)

    g_c, g_mag = random_cotangents(c_ref, mag_ref)
    expected = grads_of(polar_attention_naive, inputs64, g_c, g_mag, window=window)
    actual = grads_of(polar_attention_triton, inputs16, g_c.half(), g_mag.half(), window=window)
    assert all(a.dtype == torch.float16 for a in actual)
    assert_grads_close(actual, expected, rel=2e-2, abs_floor=2e-3)


@pytest.mark.parametrize(("shape", "seed"), [((2, 40, 40, 2, 2, 16, 0), 5), ((1, 100, 100, 2, 2, 64, 0), 12)])
def test_float16_head_scalar_gradients(shape, seed):
    """The per-head scalars' gradients are small residuals of per-query sums (d len_gain most of all).

    The preamble's delta = g_s.s_vec comes from c saved in float16; used as is, its rounding leaves each
    query a d temp bias that does not cancel (errors of 1-7% of scale at these shapes and seeds). The
    kernel recomputes delta from its own g_acc.v_j products; what remains is the rounding of c and of
    the float16 dot operands, well under 1% here. The cotangents are float16 on both sides.
    """
    b, tq, tk, h, hkv, d, window = shape
    inputs16, inputs64 = rounded(make_inputs(b, tq, tk, h, hkv, d, seed=seed), torch.float16)
    c_ref, mag_ref = polar_attention_naive(*inputs64, window=window)
    g_c, g_mag = (g.half() for g in random_cotangents(c_ref, mag_ref))
    expected = grads_of(polar_attention_naive, inputs64, g_c.double(), g_mag.double(), window=window)
    actual = grads_of(polar_attention_triton, inputs16, g_c, g_mag, window=window)
    assert_grads_close(actual[3:6], expected[3:6], rel=5e-3, abs_floor=1e-4, names=PARAM_NAMES[3:6])


def test_each_output_alone():
    """Only c, then only mag, in the loss: the other cotangent arrives as None or zeros."""
    inputs32, inputs64 = rounded(make_inputs(1, 33, 33, 2, 1, 16, seed=13), torch.float32)
    for pick in (0, 1):
        expected = torch.autograd.grad(
            polar_attention_naive(*inputs64)[pick].sum(), inputs64, allow_unused=True, materialize_grads=True
        )
        actual = torch.autograd.grad(polar_attention_triton(*inputs32)[pick].sum(), inputs32)
        assert_grads_close(actual, expected, rel=1e-4, abs_floor=1e-5)


def test_clamped_direction_norm():
    """||s_vec|| below 1e-6: c = s_vec / 1e-6 and the backward's g_s.s_vec term is no longer zero."""
    inputs = make_inputs(1, 20, 20, 2, 1, 16, seed=14)
    with torch.no_grad():
        inputs[2].mul_(1e-8)
        inputs[7].mul_(1e-8)
    inputs32, inputs64 = rounded(inputs, torch.float32)
    c_ref, mag_ref = polar_attention_naive(*inputs64)
    assert c_ref.norm(dim=-1).max() < 0.5  # really in the clamped regime
    c, _ = polar_attention_triton(*inputs32)
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=1e-6)
    g_c, g_mag = random_cotangents(c_ref, mag_ref)
    expected = grads_of(polar_attention_naive, inputs64, g_c, g_mag)
    actual = grads_of(polar_attention_triton, inputs32, g_c.float(), g_mag.float())
    assert_grads_close(actual, expected, rel=1e-4, abs_floor=1e-12)


def test_dominant_null_stays_finite():
    """A null logit far above every key would overflow e^(a_N - m) in float32; the kernel never forms it."""
    inputs = make_inputs(1, 40, 40, 2, 1, 16, seed=15)
    with torch.no_grad():
        inputs[3].fill_(1.0)  # len_gain: temp ~ 1 + 1.31 ln n
        inputs[4].fill_(40.0)  # null_base
    inputs32, inputs64 = rounded(inputs, torch.float32)
    c_ref, mag_ref = polar_attention_naive(*inputs64)
    c, mag = polar_attention_triton(*inputs32)
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mag.double(), mag_ref, rtol=1e-4, atol=1e-30)  # tiny but relative-exact
    grads = torch.autograd.grad(c.sum() + mag.sum(), inputs32)
    assert all(torch.isfinite(g).all() for g in grads)


def test_opcheck():
    inputs = make_inputs(1, 20, 24, 4, 2, 16, dtype=torch.float32, seed=16)
    fwd = torch.ops.atma.polar_attention_fwd.default
    torch.library.opcheck(fwd, (*inputs, 5))
    outputs = fwd(*[x.detach() for x in inputs], 5)
    g_c, g_mag = random_cotangents(outputs[0], outputs[1])
    args = (g_c, g_mag, *[x.detach() for x in inputs], outputs[0], *outputs[2:], 5)
    torch.library.opcheck(torch.ops.atma.polar_attention_bwd.default, args)


def test_compiled_fullgraph_with_gradient():
    """The ops compile without graph breaks (CPU, aot_eager: the kernel itself runs in the interpreter)."""
    torch._dynamo.reset()
    inputs32, inputs64 = rounded(make_inputs(1, 24, 24, 4, 2, 16, seed=17), torch.float32)

    def loss_fn(*args):
        c, mag = polar_attention_triton(*args, window=10)
        return (c * c.flip(-1)).sum() + mag.square().sum()

    def naive_loss_fn(*args):
        c, mag = polar_attention_naive(*args, window=10)
        return (c * c.flip(-1)).sum() + mag.square().sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    actual = torch.autograd.grad(compiled(*inputs32), inputs32)
    expected = torch.autograd.grad(naive_loss_fn(*inputs64), inputs64)
    assert_grads_close(actual, expected, rel=1e-4, abs_floor=1e-5)


def test_rejects_cpu_without_interpreter_and_bad_shapes(monkeypatch):
    inputs = make_inputs(1, 4, 4, 3, 2, 16, dtype=torch.float32, requires_grad=False)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError):
        polar_attention_triton(*inputs)
    inputs = make_inputs(1, 4, 4, 2, 1, 12, dtype=torch.float32, requires_grad=False)  # head_dim 12
    with pytest.raises(ValueError, match="head_dim"):
        polar_attention_triton(*inputs)
    monkeypatch.setattr(backends, "INTERPRET", False)  # as without TRITON_INTERPRET=1 (read once, at import)
    inputs = make_inputs(1, 4, 4, 2, 1, 16, dtype=torch.float32, requires_grad=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        polar_attention_triton(*inputs)


def test_single_masked_loop_variant():
    """SPLIT_MASK=False (one masked loop per program, an autotune choice on CUDA) gives the same answers."""
    from atma_titan.kernels.polar import triton_attention as tk

    kernels = (tk.polar_fwd_kernel, tk.polar_bwd_dq_kernel, tk.polar_bwd_dkdv_kernel)
    assert all(len(k.configs) == 1 for k in kernels)  # the interpreter's single config, used as is
    try:
        for kernel in kernels:
            kernel.configs[0].kwargs["SPLIT_MASK"] = False
        test_float32_forward_and_gradients(CASES["offset_queries_window"])
        test_float32_forward_and_gradients(CASES["causal_gqa4_ragged"])
    finally:
        for kernel in kernels:
            kernel.configs[0].kwargs["SPLIT_MASK"] = True
