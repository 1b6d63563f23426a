"""The gated short convolution's backward Triton kernel under the Triton interpreter (CPU), against float64
references.

Run by test_short_conv.py (alone: see this folder's conftest.py). Every launch runs under the bounds check
of tests/support/interpreter_bounds.py. Tiles shrink to 8 x 16
and row groups to 16 rows, so 3 sequences of 13 tokens take row groups that cut sequences and tiles that
cross them, over 2 channel blocks, ragged both ways. Packed documents (doc_start) begin mid-tile, at a
tile's and at a row group's first row, and last one token, against each document alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interpreter_bounds import interpreter_bounds_check
from documents import doc_start_from_lengths
from short_conv_documents import each_document_alone

from atma_titan.kernels.short_conv import gated_conv_backward, gated_conv_backward_reference, triton_short_conv
from atma_titan.models.conv import GatedShortConv
from atma_titan.models.flavors import FLAVORS


@pytest.fixture(autouse=True)
def _checked(monkeypatch):
    monkeypatch.setattr(triton_short_conv, "BLOCK_M", 8)
    monkeypatch.setattr(triton_short_conv, "BLOCK_N", 16)
    monkeypatch.setattr(triton_short_conv, "ROWS_PER_PROGRAM", 16)
    with interpreter_bounds_check():
        yield


SHAPES = [(3, 13, 20, 3), (2, 5, 7, 4), (1, 1, 3, 3), (2, 6, 4, 1), (0, 4, 5, 3)]  # batch, seq_len, channels, kernel


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("batch, seq_len, channels, kernel", SHAPES)
def test_the_kernel_matches_float64(batch, seq_len, channels, kernel, with_bias):
    g = torch.Generator().manual_seed(batch + seq_len + channels)
    u = torch.randn(batch, seq_len, 3 * channels, generator=g, dtype=torch.float64)
    do = torch.randn(batch, seq_len, channels, generator=g, dtype=torch.float64)
    weight = torch.randn(channels, kernel, generator=g, dtype=torch.float64)
    bias = torch.randn(3 * channels, generator=g, dtype=torch.float64) if with_bias else None
    want = gated_conv_backward_reference(u, do, weight, bias)
    as_fp32 = None if bias is None else bias.float()
    got = gated_conv_backward(u.float(), do.float(), weight.float(), as_fp32, impl="triton")
    assert [t.dtype for t in got] == [torch.float32] * 4
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-4)


def test_bf16_input_comes_back_in_bf16_with_fp32_sums():
    g = torch.Generator().manual_seed(1)
    u = torch.randn(2, 21, 60, generator=g).bfloat16()
    do = torch.randn(2, 21, 20, generator=g).bfloat16()
    weight = torch.randn(20, 3, generator=g).bfloat16()
    bias = torch.randn(60, generator=g).bfloat16()
    want = gated_conv_backward_reference(u.double(), do.double(), weight.double(), bias.double())
    got = gated_conv_backward(u, do, weight, bias, impl="triton")
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    # the interpreter truncates on the cast to bf16 where a GPU rounds: allow one bf16 step
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a.double(), b, rtol=2**-7, atol=1e-5)
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-4)


def test_the_mixer_through_the_kernel_has_autograds_gradients():
    torch.manual_seed(0)
    mixer = GatedShortConv(dataclasses.replace(FLAVORS["debug"], d_model=24, conv_impl="triton"))
    for p in mixer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    h = torch.randn(2, 19, 24, requires_grad=True)
    out, _ = mixer(h)
    b, c, x = mixer.in_proj(h).chunk(3, dim=-1)
    want_out = mixer.out_proj(c * mixer.conv(b * x))
    dout = torch.randn_like(out)
    params = [h, *mixer.parameters()]
    torch.testing.assert_close(out, want_out)
    for a, b in zip(torch.autograd.grad(out, params, dout), torch.autograd.grad(want_out, params, dout)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# rows 0-51 in tiles of 8 and groups of 16: documents at rows 5 (mid-tile), 8 and 9 (a tile's first row, then
# two of one token), 10; 16 (a row group's first, sequence 1's position 3), 20; one whole sequence; all ones
DOCUMENTS = [[5, 3, 1, 1, 3], [3, 4, 6], [13], [1] * 13]


@pytest.mark.parametrize("kernel", [3, 4])
def test_packed_documents_have_each_documents_gradients_alone(kernel):
    g = torch.Generator().manual_seed(kernel)
    u = torch.randn(4, 13, 60, generator=g, dtype=torch.float64)
    do = torch.randn(4, 13, 20, generator=g, dtype=torch.float64)
    weight = torch.randn(20, kernel, generator=g, dtype=torch.float64)
    bias = torch.randn(60, generator=g, dtype=torch.float64)
    doc_start = doc_start_from_lengths(DOCUMENTS)
    want = each_document_alone(u, do, weight, bias, doc_start)
    got = gated_conv_backward(u.float(), do.float(), weight.float(), bias.float(), doc_start, impl="triton")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-4)


def test_one_document_a_sequence_runs_as_no_documents():
    g = torch.Generator().manual_seed(2)
    u, do = torch.randn(2, 13, 60, generator=g), torch.randn(2, 13, 20, generator=g)
    weight = torch.randn(20, 3, generator=g)
    one = torch.zeros(2, 13, dtype=torch.int32)
    got = gated_conv_backward(u, do, weight, None, one, impl="triton")
    for a, b in zip(got, gated_conv_backward(u, do, weight, impl="triton")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
