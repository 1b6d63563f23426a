"""Muon's element-wise Triton kernels under the Triton interpreter (CPU), against float64 and the reference.

Run by test_muon_update.py (alone: see this folder's conftest.py). The kernels reach their matrices
through pointer tables, which the bounds check of tests/support/interpreter_bounds.py cannot follow: every
tensor lies instead inside a larger one filled with a sentinel that no write may touch. The block is shrunk
to 64 elements so that matrices take several programs and a ragged last one; the update views are a
transposed slot, a padded slot and a plain tensor.
"""

from __future__ import annotations

import pytest
import torch

from atma_titan.kernels.muon_update import (
    apply_updates_,
    apply_updates_reference_,
    stage_momentum_,
    stage_momentum_reference_,
    triton_muon,
)

SHAPES = [(3, 50), (20, 7), (9, 9)]  # 150, 140 and 81 elements: 3, 3 and 2 blocks of 64
SENTINEL = 7.0


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(triton_muon, "BLOCK", 64)


def fenced(shape, gen, dtype=torch.float32):
    """A random tensor of `shape` in the middle of a sentinel-filled buffer, and the buffer."""
    n = shape[0] * shape[1]
    whole = torch.full((n + 200,), SENTINEL, dtype=dtype)
    whole[100 : 100 + n] = torch.randn(n, generator=gen).to(dtype)
    return whole[100 : 100 + n].view(shape), whole


def update_views(gen, fill_random: bool):
    """bf16 views of each shape: a transposed slot and a padded slot of one batch, and a plain tensor."""
    batch = torch.full((2, 56, 16), SENTINEL, dtype=torch.bfloat16)
    plain = torch.full((9 * 9 + 64,), SENTINEL, dtype=torch.bfloat16)
    views = [batch[0, :50, :3].mT, batch[1, :20, :7], plain[32 : 32 + 81].view(9, 9)]
    assert [tuple(v.shape) for v in views] == SHAPES and views[0].stride() == (1, 16)
    if fill_random:
        for v in views:
            v.copy_(torch.randn(v.shape, generator=gen))
    return views, [batch, plain]


def untouched(buffers_before, buffers_after, inner):
    """Every element of each buffer outside the `inner` views still holds what it held before."""
    for before, after in zip(buffers_before, buffers_after):
        outside = torch.ones_like(after, dtype=torch.bool)
        for view in inner:
            if view.untyped_storage().data_ptr() == after.untyped_storage().data_ptr():
                offset = (view.data_ptr() - after.data_ptr()) // after.element_size()
                index = torch.as_strided(torch.arange(after.numel()), view.shape, view.stride(), offset)
                outside.view(-1)[index.reshape(-1)] = False
        assert torch.equal(after[outside], before[outside])


def device_scalar(value: float | None) -> torch.Tensor | None:
    return None if value is None else torch.tensor(value)


@pytest.mark.parametrize(
    "nesterov, scale, skip",
    [(True, None, None), (False, None, None), (True, 0.3, 0.0), (False, 0.3, None), (True, None, 0.0)],
)
def test_stage_writes_the_momentum_into_the_buffer_and_the_update_into_its_view(nesterov, scale, skip):
    gen = torch.Generator().manual_seed(int(nesterov) + 2 * int(scale is not None))
    grads, grad_bufs = zip(*(fenced(s, gen) for s in SHAPES))
    bufs, buf_bufs = zip(*(fenced(s, gen) for s in SHAPES))
    outs, out_bufs = update_views(gen, fill_random=False)
    g64 = [g.double() * (1.0 if scale is None else torch.tensor(scale).double()) for g in grads]
    b64 = [b.double() for b in bufs]
    snapshot = [t.clone() for t in [*grad_bufs, *buf_bufs, *out_bufs]]

    stage_momentum_(list(grads), list(bufs), outs, 0.95, nesterov, grad_scale=device_scalar(scale),
                    skip=device_scalar(skip), impl="triton")  # fmt: skip

    for b, out, g_was, b_was in zip(bufs, outs, g64, b64):
        m = b_was + 0.05 * (g_was - b_was)
        u = g_was + 0.95 * (m - g_was) if nesterov else m
        torch.testing.assert_close(b.double(), m, rtol=1e-6, atol=1e-6)
        # One bf16 step: the interpreter's cast truncates where the GPU's rounds to nearest.
        torch.testing.assert_close(out.double(), u, rtol=2**-7, atol=1e-6)
    untouched(snapshot, [*grad_bufs, *buf_bufs, *out_bufs], [*bufs, *outs])  # the gradients are only read

    # The PyTorch reference gives the same values (it is what CPU training runs).
    gen = torch.Generator().manual_seed(int(nesterov) + 2 * int(scale is not None))
    ref_grads, _ = zip(*(fenced(s, gen) for s in SHAPES))
    ref_bufs, _ = zip(*(fenced(s, gen) for s in SHAPES))
    ref_outs = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
    stage_momentum_reference_(list(ref_grads), list(ref_bufs), ref_outs, 0.95, nesterov, device_scalar(scale),
                              device_scalar(skip))  # fmt: skip
    for b, r, out, ref_out in zip(bufs, ref_bufs, outs, ref_outs):
        torch.testing.assert_close(b, r, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-7, atol=1e-6)


def test_a_skipped_stage_leaves_every_buffer_as_it_was_even_with_non_finite_gradients():
    gen = torch.Generator().manual_seed(11)
    grads, grad_bufs = zip(*(fenced(s, gen) for s in SHAPES))
    grads[0][1, 2], grads[1][0, 0] = float("nan"), float("inf")
    bufs, buf_bufs = zip(*(fenced(s, gen) for s in SHAPES))
    before = [t.clone() for t in [*grad_bufs, *buf_bufs]]
    nan, skip = torch.tensor(float("nan")), torch.tensor(1.0)
    outs, _ = update_views(gen, fill_random=False)
    stage_momentum_(list(grads), list(bufs), outs, 0.95, True, grad_scale=nan, skip=skip, impl="triton")
    ref_outs = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
    stage_momentum_reference_(list(grads), list(bufs), ref_outs, 0.95, True, nan, skip)
    for was, now in zip(before, [*grad_bufs, *buf_bufs]):
        torch.testing.assert_close(now, was, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("skip", [None, 0.0, 1.0])
def test_apply_decays_and_adds_each_matrix_its_own_alpha_unless_skipped(skip):
    gen = torch.Generator().manual_seed(3)
    params, param_bufs = zip(*(fenced(s, gen) for s in SHAPES))
    updates, update_bufs = update_views(gen, fill_random=True)
    alphas = [-0.02, -0.02 * 2.5, -0.03]
    p64 = [p.double() for p in params]
    snapshot = [t.clone() for t in [*param_bufs, *update_bufs]]

    apply_updates_(list(params), updates, 0.9998, alphas, skip=device_scalar(skip), impl="triton")

    for p, u, a, p_was in zip(params, updates, alphas, p64):
        expected = p_was if skip == 1.0 else p_was * 0.9998 + a * u.double()
        torch.testing.assert_close(p.double(), expected, rtol=1e-6, atol=1e-7)
    untouched(snapshot, [*param_bufs, *update_bufs], list(params))

    ref = [p_was.float() for p_was in p64]
    apply_updates_reference_(ref, updates, 0.9998, alphas, device_scalar(skip))
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    if skip == 1.0:
        assert all(torch.equal(p, p_was.float()) for p, p_was in zip(params, p64))


def test_muon_through_the_kernels_equals_muon_through_the_reference():
    from atma_titan.optim import Muon

    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(s, generator=gen) for s in [(40, 24), (40, 24), (24, 40), (3, 50), (96, 40)]]
    runs = []
    for impl in ("triton", "reference"):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = Muon(params, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, elementwise_impl=impl)
        g = torch.Generator().manual_seed(6)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        runs.append(params)
    for p, q in zip(*runs):  # bf16 Newton-Schulz of inputs one bf16 rounding apart (the interpreter truncates)
        torch.testing.assert_close(p, q, rtol=0, atol=2e-3)
