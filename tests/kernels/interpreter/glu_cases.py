"""The GLU backward Triton kernel under the Triton interpreter (CPU), against float64 references.

Run by test_glu.py (alone: see this folder's conftest.py). Every launch runs under the bounds check of
tests/support/interpreter_bounds.py. Tiles shrink to 8 x 16
and row groups to 16 rows, so M = 37 and N = 40 take 3 x 3 programs of several tiles, ragged both ways.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_bounds import interpreter_bounds_check

from atma_titan.kernels.glu import glu, glu_backward, glu_backward_reference, triton_glu
from atma_titan.models.layers import MLP


@pytest.fixture(autouse=True)
def _checked(monkeypatch):
    monkeypatch.setattr(triton_glu, "BLOCK_M", 8)
    monkeypatch.setattr(triton_glu, "BLOCK_N", 16)
    monkeypatch.setattr(triton_glu, "ROWS_PER_PROGRAM", 16)
    with interpreter_bounds_check():
        yield


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("kind", ["relu2", "swiglu"])
@pytest.mark.parametrize("rows, hidden", [(37, 40), (5, 16), (1, 3), (0, 8)])
def test_the_kernel_matches_float64(kind, rows, hidden, with_bias):
    g = torch.Generator().manual_seed(rows + hidden)
    fc = torch.randn(rows, 2 * hidden, generator=g, dtype=torch.float64)
    dh = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    fc_bias = torch.randn(2 * hidden, generator=g, dtype=torch.float64) if with_bias else None
    want_dfc, want_h, want_bias = glu_backward_reference(fc, dh, kind, fc_bias)
    as_fp32 = None if fc_bias is None else fc_bias.float()
    dfc, h, bias = glu_backward(fc.float(), dh.float(), kind, as_fp32, impl="triton")
    assert (dfc.dtype, h.dtype, bias.dtype) == (torch.float32, torch.float32, torch.float32)
    torch.testing.assert_close(dfc.double(), want_dfc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.double(), want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.double(), want_bias, rtol=1e-5, atol=1e-4)


def test_bf16_input_comes_back_in_bf16_with_fp32_column_sums():
    g = torch.Generator().manual_seed(1)
    fc = torch.randn(37, 80, generator=g).bfloat16()
    dh = torch.randn(37, 40, generator=g).bfloat16()
    fc_bias = torch.randn(80, generator=g).bfloat16()
    want_dfc, want_h, want_bias = glu_backward_reference(fc.double(), dh.double(), "relu2", fc_bias.double())
    dfc, h, bias = glu_backward(fc, dh, "relu2", fc_bias, impl="triton")
    assert (dfc.dtype, h.dtype, bias.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    # the interpreter truncates on the cast to bf16 where a GPU rounds: allow one bf16 step
    torch.testing.assert_close(dfc.double(), want_dfc, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(h.double(), want_h, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(bias.double(), want_bias, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["relu2", "swiglu"])
def test_the_mlp_through_the_kernel_has_autograds_gradients(kind):
    torch.manual_seed(0)
    mlp = MLP(24, 40, kind, "triton")
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 19, 24, requires_grad=True)
    out = mlp(x)
    dout = torch.randn_like(out)
    params = [x, *mlp.parameters()]
    got = torch.autograd.grad(out, params, dout)
    want_out = mlp.proj(glu(mlp.fc(x), kind))
    want = torch.autograd.grad(want_out, params, dout)
    torch.testing.assert_close(out, want_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
