"""Muon's element-wise kernels: interpreter cases (in a subprocess), and fp32 on the GPU against the
PyTorch reference (skipped without CUDA):
    python -m pytest -q -p no:cacheprovider tests/kernels/test_muon_update.py -m gpu
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


@pytest.mark.parametrize("skip", [0.0, 1.0])
def test_the_reference_selects_on_the_device_where_the_host_cannot_read_the_flag(monkeypatch, skip):
    """On a GPU the reference's passes select with the flag where it lies (no sync); on the CPU the host reads
    it. Both give the same buffers and parameters: a skip leaves them as they were, NaN gradients included."""
    from atma_titan.kernels.muon_update import reference

    shapes = [(6, 4), (3, 9)]
    results = []
    for on_host in (True, False):
        if not on_host:
            monkeypatch.setattr(reference, "_skipped_on_host", lambda flag: None if flag is not None else False)
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(s, generator=gen) for s in shapes]
        grads[0][0, 0] = float("nan") if skip else 0.5
        bufs = [torch.randn(s, generator=gen) for s in shapes]
        params = [torch.randn(s, generator=gen) for s in shapes]
        before = [t.clone() for t in bufs + params]
        outs = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
        flag = torch.tensor(skip)
        reference.stage_momentum_reference_(grads, bufs, outs, 0.95, True, torch.tensor(0.7), flag)
        reference.apply_updates_reference_(params, outs, 0.999, [-0.02, -0.03], flag)
        if skip:
            assert all(torch.equal(a, b) for a, b in zip(before, bufs + params))
        results.append(bufs + params)
    assert all(torch.equal(a, b) for a, b in zip(*results))
