"""Muon's element-wise kernels: interpreter cases (in a subprocess), and fp32 on the GPU against the
PyTorch reference (skipped without CUDA):
    python -m pytest -q -p no:cacheprovider tests/test_muon_update.py -m gpu
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import run_interpreter_cases

from atma_titan.optim import Muon

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_under_the_triton_interpreter():
    run_interpreter_cases("muon_update_cases.py")


def test_muon_on_the_cpu_takes_the_reference_unless_asked():
    params = [torch.nn.Parameter(torch.randn(8, 4))]
    params[0].grad = torch.randn(8, 4)
    Muon(params, lr=0.02).step()  # auto: the reference on the CPU, no interpreter needed
    with pytest.raises(RuntimeError, match="cannot run on cpu"):
        Muon(params, lr=0.02, elementwise_impl="triton").step()


@pytest.mark.gpu
@needs_cuda
def test_muon_steps_through_the_kernels_on_the_gpu_as_through_the_reference():
    """The 370M model's matrix shapes in miniature: square, wide, tall (not turned), small ones padded."""
    torch.manual_seed(0)
    shapes = [(1024, 1024)] * 3 + [(2816, 1024), (1024, 2816), (16, 1024), (1024, 4), (64, 1)]
    runs = []
    for impl in ("triton", "reference"):
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=None)) for s in shapes]
        torch.manual_seed(1)
        opt = Muon(params, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, elementwise_impl=impl)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        runs.append((params, [opt.state[p]["momentum_buffer"] for p in params]))
        torch.manual_seed(0)
    for p, q in zip(runs[0][0], runs[1][0]):  # a wrong update is off by ~lr = 0.02; a bf16 rounding by far less
        torch.testing.assert_close(p, q, rtol=0, atol=1e-4)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
