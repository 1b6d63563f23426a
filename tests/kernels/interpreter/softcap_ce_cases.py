"""The soft-capped cross-entropy Triton kernels under the Triton interpreter (CPU), against float64 references.

Run by test_softcap_ce.py (alone: see this folder's conftest.py). Every launch runs under the bounds check
of tests/support/interpreter_bounds.py. The row kernel's step
is shrunk to 64 logits so that rows take several steps and a ragged last one; the gradient kernel's 128
columns and a 16-row group split V = 300 and M = 37 into 3 x 3 programs, both ragged.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_bounds import interpreter_bounds_check

from atma_titan.kernels.softcap_ce import (
    softcap_ce_backward_,
    softcap_ce_backward_reference,
    softcap_ce_forward,
    softcap_ce_forward_reference,
    triton_ce,
)
from atma_titan.models.loss import linear_softcap_cross_entropy


@pytest.fixture(autouse=True)
def _checked(monkeypatch):
    monkeypatch.setattr(triton_ce, "ROW_BLOCK", 64)
    with interpreter_bounds_check():
        yield


def problem(rows: int, vocab: int, scale_logits: float = 10.0, seed: int = 0):
    """fp32 logits (some far past the cap), targets with ignored rows, fresh weights in [0, 2)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale_logits
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[torch.rand(rows, generator=g) < 0.2] = -1
    scale = torch.rand(rows, generator=g) * 2
    return logits, targets, scale


@pytest.mark.parametrize("cap", [15.0, 0.0])
@pytest.mark.parametrize("rows, vocab", [(37, 300), (5, 64), (1, 1000)])
def test_forward_and_in_place_gradient_match_float64(cap, rows, vocab):
    logits, targets, scale = problem(rows, vocab)
    loss, lse = softcap_ce_forward(logits, targets, scale, cap, impl="triton")
    want_loss, want_lse = softcap_ce_forward_reference(logits.double(), targets, scale.double(), cap)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-5)
    assert torch.all(loss[targets < 0] == 0)

    grad = logits.clone()
    bias = triton_ce.softcap_ce_backward_(grad, lse, targets, scale, cap, bias_grad=True, rows_per_program=16)
    want = softcap_ce_backward_reference(logits.double(), want_lse, targets, scale.double(), cap)
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-6)  # written over the logits
    torch.testing.assert_close(bias.double(), want.sum(0), rtol=1e-5, atol=1e-5)
    assert torch.all(grad[targets < 0] == 0)


def test_every_row_group_writes_its_share_of_the_column_sums():
    logits, targets, scale = problem(37, 300, seed=1)
    _, lse = softcap_ce_forward(logits, targets, scale, 15.0, impl="triton")
    sums = [
        triton_ce.softcap_ce_backward_(logits.clone(), lse, targets, scale, 15.0, True, rows_per_program=per)
        for per in (16, 32, 1024)  # 3, 2 and 1 row groups
    ]
    for other in sums[1:]:
        torch.testing.assert_close(other, sums[0], rtol=1e-6, atol=1e-6)
    assert softcap_ce_backward_(logits.clone(), lse, targets, scale, 15.0, impl="triton") is None  # no bias asked


@pytest.mark.parametrize("weighted", [False, True])
def test_the_fused_loss_through_the_kernel_equals_the_pytorch_chunks(weighted):
    g = torch.Generator().manual_seed(2)
    n, d, vocab = 29, 16, 300
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, d, generator=g) * 0.8).requires_grad_()
    bias = torch.randn(vocab, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::5] = -100
    weights = torch.rand(n, generator=g) * 2 if weighted else None
    results = []
    for impl in ("triton", "reference"):
        loss = linear_softcap_cross_entropy(hidden, weight, bias, labels, weights, cap=15.0, chunk_tokens=11, impl=impl)
        grads = torch.autograd.grad(loss, (hidden, weight, bias))
        results.append((loss, *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
