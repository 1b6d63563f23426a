"""The MLP's GLU backward (atma_titan.kernels.glu): interpreter cases (in a subprocess), the reference and the
MLP's hand-written backward against autograd in float64 (with the kernel's selection, autocast and selective
AC), and bf16 on the GPU against float64 (skipped without CUDA):
    python -m pytest -q -p no:cacheprovider tests/kernels/test_glu.py -m gpu
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from helpers import run_interpreter_cases
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from atma_titan.kernels.glu import glu, glu_backward, glu_backward_reference
from atma_titan.models.layers import MLP
from atma_titan.parallel.parallelize import selective_policy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_under_the_triton_interpreter():
    run_interpreter_cases("glu_cases.py")


def mlp_and_input(kind: str, dtype=torch.float64, device="cpu", impl="reference", seed=0):
    torch.manual_seed(seed)
    mlp = MLP(24, 40, kind, impl).to(device, dtype)
    for p in mlp.parameters():  # the model zeroes proj at init: use random weights everywhere
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 11, 24, dtype=dtype, device=device, requires_grad=True)
    return mlp, x


def autograd_mlp(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.proj(glu(mlp.fc(x), mlp.kind))


@pytest.mark.parametrize("kind", ["relu2", "swiglu"])
def test_the_reference_is_autograds_gradient(kind):
    u = torch.randn(13, 16, dtype=torch.float64, requires_grad=True)
    fc_bias = torch.randn(16, dtype=torch.float64, requires_grad=True)
    h = glu(u + fc_bias, kind)
    dh = torch.randn_like(h)
    want, want_bias = torch.autograd.grad(h, [u, fc_bias], dh)
    dfc, h_again, bias = glu_backward_reference(u.detach(), dh, kind, fc_bias.detach())
    torch.testing.assert_close(dfc, want)
    torch.testing.assert_close(h_again, h.detach())
    torch.testing.assert_close(bias, want_bias)


@pytest.mark.parametrize("kind", ["relu2", "swiglu"])
def test_the_mlps_backward_is_autograds(kind):
    mlp, x = mlp_and_input(kind)
    out = mlp(x)
    want_out = autograd_mlp(mlp, x)
    dout = torch.randn_like(out)
    params = [x, *mlp.parameters()]
    for got, want in zip(torch.autograd.grad(out, params, dout), torch.autograd.grad(want_out, params, dout)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(out, want_out)


def test_the_mlp_takes_the_glu_pass_only_when_gradients_flow(monkeypatch):
    import atma_titan.models.layers as layers

    calls = []
    monkeypatch.setattr(layers, "glu_backward", lambda *a, **k: calls.append(k) or glu_backward(*a, **k))
    mlp, x = mlp_and_input("relu2")
    with torch.no_grad():
        mlp(x)
    mlp(x.detach()).sum().backward()  # weights only
    assert calls == [{"impl": "reference", "what": "model.mlp_impl"}]
    mlp.requires_grad_(False)
    mlp(x.detach())
    assert mlp(x).grad_fn is not None and len(calls) == 1


def test_the_function_saves_only_its_inputs_and_fcs_matmul_stays_outside_it():
    """A compiled checkpoint tags the ops it may recompute, but not those inside an autograd.Function: on the
    H200 a Function that ran fc's matmul itself made full AC keep fc (256 MiB a block at micro-batch 8).
    So the Function saves only inputs: u (fc's matmul, done outside it), fc's bias and proj's weight."""
    mlp, x = mlp_and_input("relu2")
    out = mlp(x)  # kept: torch 2.11 frees a Function's saved tensors with its output
    node = out.grad_fn
    assert type(node).__name__ == "_GLUMLPBackward"
    u, fc_bias, proj_weight = node.saved_tensors
    assert fc_bias is mlp.fc.bias and proj_weight is mlp.proj.weight
    torch.testing.assert_close(u, torch.nn.functional.linear(x, mlp.fc.weight), rtol=0, atol=0)
    matmul = node.next_functions[0][0]  # u's producer: fc's matmul (a view of it for 3-D input)
    assert "Mm" in type(matmul).__name__ or any("Mm" in type(f).__name__ for f, _ in matmul.next_functions)


def test_under_selective_ac_the_gradients_are_unchanged():
    mlp, x = mlp_and_input("relu2")
    dout = torch.randn(3, 11, 24, dtype=torch.float64)
    context = functools.partial(create_selective_checkpoint_contexts, selective_policy())
    out = checkpoint(mlp, x, use_reentrant=False, context_fn=context)
    params = [x, *mlp.parameters()]
    got = torch.autograd.grad(out, params, dout)
    want = torch.autograd.grad(autograd_mlp(mlp, x), params, dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_under_autocast_the_matmuls_run_in_bf16_and_gradients_keep_the_parameters_dtype():
    mlp, x = mlp_and_input("relu2", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mlp(x)
        want_out = autograd_mlp(mlp, x)
    assert out.dtype == torch.bfloat16
    dout = torch.randn_like(out)
    params = [x, *mlp.parameters()]
    got = torch.autograd.grad(out, params, dout)
    want = torch.autograd.grad(want_out, params, dout)
    for a, b, p in zip(got, want, params):
        assert a.dtype == p.dtype == torch.float32
        assert (a - b).norm() <= 1e-2 * b.norm()  # bf16 matmuls both ways, rounded in other places


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="'gelu' is unknown; allowed: relu2, swiglu"):
        MLP(4, 8, "gelu")
    with pytest.raises(ValueError, match="allowed: relu2, swiglu"):
        glu_backward(torch.zeros(2, 4), torch.zeros(2, 2), "gelu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["relu2", "swiglu"])
def test_bf16_on_the_gpu_matches_float64(kind):
    torch.manual_seed(0)
    fc = torch.randn(5000, 2 * 4096, device="cuda").bfloat16()
    dh = torch.randn(5000, 4096, device="cuda").bfloat16()
    fc_bias = torch.randn(2 * 4096, device="cuda").bfloat16()
    want_dfc, want_h, want_bias = glu_backward_reference(fc.double(), dh.double(), kind, fc_bias.double())
    dfc, h, bias = glu_backward(fc, dh, kind, fc_bias, impl="triton")
    # one bf16 rounding of each output; the column sums in fp32 over 5,000 rows
    torch.testing.assert_close(dfc.double(), want_dfc, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(h.double(), want_h, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(bias.double(), want_bias, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_the_compiled_mlp_under_selective_ac_on_the_gpu_has_autograds_gradients():
    mlp, x = mlp_and_input("relu2", dtype=torch.float32, device="cuda", impl="triton")
    context = functools.partial(create_selective_checkpoint_contexts, selective_policy())
    step = torch.compile(lambda x: checkpoint(mlp, x, use_reentrant=False, context_fn=context), fullgraph=True)
    out = step(x)
    dout = torch.randn_like(out)
    params = [x, *mlp.parameters()]
    got = torch.autograd.grad(out, params, dout)
    want = torch.autograd.grad(autograd_mlp(mlp, x), params, dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
