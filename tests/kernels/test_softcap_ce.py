"""The LM head's soft-capped cross-entropy kernel: interpreter cases (in a subprocess), the CPU selection, and
bf16 on the GPU against float64 (skipped without CUDA):
    python -m pytest -q -p no:cacheprovider tests/kernels/test_softcap_ce.py -m gpu
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import run_interpreter_cases

from atma_titan.kernels.softcap_ce import (
    kernel_runs,
    softcap_ce_backward_,
    softcap_ce_backward_reference,
    softcap_ce_forward,
    softcap_ce_forward_reference,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_under_the_triton_interpreter():
    run_interpreter_cases("softcap_ce_cases.py")


def test_auto_takes_the_kernel_on_cuda_only_and_never_for_float64():
    triton_installed = importlib.util.find_spec("triton") is not None
    assert kernel_runs(torch.bfloat16, torch.device("cuda"), "auto", "x") == triton_installed
    assert not kernel_runs(torch.float64, torch.device("cuda"), "auto", "x")
    assert not kernel_runs(torch.bfloat16, torch.device("cpu"), "auto", "x")
    assert not kernel_runs(torch.bfloat16, torch.device("cuda"), "reference", "x")


def test_the_reference_path_overwrites_the_logits_with_their_gradient():
    logits = torch.randn(6, 40, dtype=torch.float64) * 20
    targets = torch.tensor([3, -1, 0, 39, 7, 7])
    scale = torch.rand(6, dtype=torch.float64)
    loss, lse = softcap_ce_forward(logits, targets, scale, 15.0, impl="reference")
    z = logits.clone().requires_grad_()
    capped = 15.0 * z / torch.sqrt(z.square() + 225.0)
    want = torch.nn.functional.cross_entropy(capped, targets.clamp(min=0), reduction="none") * scale * (targets >= 0)
    torch.testing.assert_close(loss, want.detach())
    (want_grad,) = torch.autograd.grad(want.sum(), z)
    grad = logits.clone()
    bias = softcap_ce_backward_(grad, lse, targets, scale, 15.0, bias_grad=True, impl="reference")
    torch.testing.assert_close(grad, want_grad)
    torch.testing.assert_close(bias, want_grad.sum(0))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cap", [15.0, 0.0])
def test_bf16_logits_on_the_gpu_match_float64(cap):
    torch.manual_seed(0)
    rows, vocab = 3000, 50_304
    logits = (torch.randn(rows, vocab, device="cuda") * 8).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    targets[::9] = -1
    scale = torch.rand(rows, device="cuda")
    loss, lse = softcap_ce_forward(logits, targets, scale, cap, impl="triton")
    want_loss, want_lse = softcap_ce_forward_reference(logits.double(), targets, scale.double(), cap)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-5)
    grad = logits.clone()
    bias = softcap_ce_backward_(grad, lse, targets, scale, cap, bias_grad=True, impl="triton")
    want = softcap_ce_backward_reference(logits.double(), want_lse, targets, scale.double(), cap)
    torch.testing.assert_close(grad.double(), want, rtol=1e-2, atol=1e-4)  # bf16 storage of the gradient
    torch.testing.assert_close(bias.double(), want.sum(0), rtol=1e-5, atol=1e-4)
