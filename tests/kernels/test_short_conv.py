"""The LFM2 conv block's one-pass backward (atma_titan.kernels.short_conv, models/conv.py): interpreter cases (in
a subprocess), the reference and the mixer's hand-written backward against autograd in float64 (with the
kernel's selection, generation's conv state, autocast and selective AC), packed documents (doc_start) against
each document alone, and bf16 on the GPU against float64 (skipped without CUDA):
    python -m pytest -q -p no:cacheprovider tests/kernels/test_short_conv.py -m gpu
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from helpers import run_interpreter_cases
from documents import doc_start_from_lengths
from short_conv_documents import each_document_alone
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from atma_titan.kernels.short_conv import causal_conv, gated_conv, gated_conv_backward, gated_conv_backward_reference
from atma_titan.models.conv import GatedShortConv
from atma_titan.models.flavors import FLAVORS
from atma_titan.parallel.parallelize import selective_policy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_under_the_triton_interpreter():
    run_interpreter_cases("short_conv_cases.py")


def mixer_and_input(dtype=torch.float64, device="cpu", impl="reference", d_model=24, seq_len=11, seed=0):
    torch.manual_seed(seed)
    mixer = GatedShortConv(dataclasses.replace(FLAVORS["debug"], d_model=d_model, conv_impl=impl)).to(device, dtype)
    for p in mixer.parameters():  # the model zeroes out_proj at init: use random weights everywhere
        torch.nn.init.normal_(p, std=0.5)
    h = torch.randn(3, seq_len, d_model, dtype=dtype, device=device, requires_grad=True)
    return mixer, h


def autograd_mixer(mixer: GatedShortConv, h: torch.Tensor) -> torch.Tensor:
    b, c, x = mixer.in_proj(h).chunk(3, dim=-1)
    return mixer.out_proj(c * mixer.conv(b * x))


def grads(out, params, dout):
    return torch.autograd.grad(out, params, dout)


@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_the_reference_is_autograds_gradient(kernel):
    u = torch.randn(2, 9, 15, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(15, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, kernel, dtype=torch.float64, requires_grad=True)
    o = gated_conv(u + bias, weight)
    do = torch.randn_like(o)
    want_du, want_bias, want_weight = grads(o, [u, bias, weight], do)
    du, o_again, bias_grad, weight_grad = gated_conv_backward_reference(u.detach(), do, weight.detach(), bias.detach())
    torch.testing.assert_close(du, want_du)
    torch.testing.assert_close(o_again, o.detach())
    torch.testing.assert_close(bias_grad, want_bias)
    torch.testing.assert_close(weight_grad, want_weight)


def test_sequences_do_not_mix():
    """Each sequence starts from zero padding and its gradient stops at its end: changing one sequence
    changes no other sequence's outputs or input gradients."""
    u, do, weight = (torch.randn(*shape, dtype=torch.float64) for shape in [(2, 7, 12), (2, 7, 4), (4, 3)])
    first = gated_conv_backward_reference(u, do, weight)
    u2, do2 = u.clone(), do.clone()
    u2[1], do2[1] = torch.randn_like(u[1]), torch.randn_like(do[1])
    second = gated_conv_backward_reference(u2, do2, weight)
    torch.testing.assert_close(first[0][0], second[0][0])
    torch.testing.assert_close(first[1][0], second[1][0])


# documents at 0 only, mid-sequence, of length 1 (two in a row, one last), every token one, one at position 2
DOCUMENTS = [[10], [3, 1, 1, 4, 1], [1] * 10, [2, 8]]


@pytest.mark.parametrize("kernel", [1, 3, 4])
def test_packed_documents_have_each_documents_outputs_and_gradients_alone(kernel):
    doc_start = doc_start_from_lengths(DOCUMENTS)
    u = torch.randn(4, 10, 15, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(15, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, kernel, dtype=torch.float64, requires_grad=True)
    do = torch.randn(4, 10, 5, dtype=torch.float64)
    want = each_document_alone(u.detach(), do, weight.detach(), bias.detach(), doc_start)
    got = gated_conv_backward_reference(u.detach(), do, weight.detach(), bias.detach(), doc_start)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    o = gated_conv(u + bias, weight, doc_start)
    torch.testing.assert_close(o.detach(), want[1])
    for a, b in zip(grads(o, [u, bias, weight], do), [want[0], want[2], want[3]]):
        torch.testing.assert_close(a, b)


def test_one_document_a_sequence_is_no_documents():
    u, do, weight, bias = (torch.randn(*shape, dtype=torch.float64) for shape in [(2, 9, 12), (2, 9, 4), (4, 3), (12,)])
    one = torch.zeros(2, 9, dtype=torch.int32)
    for a, b in zip(
        gated_conv_backward_reference(u, do, weight, bias, one), gated_conv_backward_reference(u, do, weight, bias)
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(gated_conv(u, weight, one), gated_conv(u, weight), rtol=0, atol=0)


def test_causal_conv_reads_the_history_before_the_window_only_for_the_document_it_continues():
    """Generation's conv state stands in for the padding: the window's first document (doc_start 0) reads it,
    a document that begins later reads nothing before its start."""
    k, doc_start = 3, doc_start_from_lengths([[4, 1, 2], [7], [1] * 7])
    history, x = torch.randn(3, k - 1, 6, dtype=torch.float64), torch.randn(3, 7, 6, dtype=torch.float64)
    weight = torch.randn(6, k, dtype=torch.float64)
    padded = torch.cat([history, x], dim=1)
    want = torch.zeros_like(x)
    for b, t, j in ((b, t, j) for b in range(3) for t in range(7) for j in range(k)):
        read = t - (k - 1) + j  # the input position tap j of output t reads (< 0: the history)
        if read >= doc_start[b, t] or doc_start[b, t] == 0:
            want[b, t] += weight[:, j] * padded[b, t + j]
    torch.testing.assert_close(causal_conv(padded, weight, doc_start), want)
    first_document = doc_start == 0
    plain = causal_conv(padded, weight)
    torch.testing.assert_close(causal_conv(padded, weight, doc_start)[first_document], plain[first_document])


def test_a_doc_start_of_the_wrong_shape_or_dtype_is_refused():
    u, do, weight = torch.randn(2, 5, 12), torch.randn(2, 5, 4), torch.randn(4, 3)
    padded = torch.randn(2, 7, 4)
    for bad in [torch.zeros(2, 4, dtype=torch.int32), torch.zeros(5, dtype=torch.int32), torch.zeros(2, 5)]:
        for call in [
            lambda: causal_conv(padded, weight, bad),
            lambda: gated_conv(u, weight, bad),
            lambda: gated_conv_backward_reference(u, do, weight, None, bad),
            lambda: gated_conv_backward(u, do, weight, None, bad, impl="reference"),
        ]:
            with pytest.raises(ValueError, match="doc_start"):
                call()


def test_the_custom_ops_fake_takes_a_doc_start():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        u, do, weight, bias = torch.empty(2, 5, 12), torch.empty(2, 5, 4), torch.empty(4, 3), torch.empty(12)
        doc_start = torch.zeros(2, 5, dtype=torch.int32)
        dz, o, sums, dw = torch.ops.atma.gated_conv_backward(u, do, weight, bias, doc_start)
    assert (dz.shape, o.shape, sums.shape, dw.shape) == (u.shape, do.shape, bias.shape, weight.shape)


def test_the_mixers_backward_is_autograds():
    mixer, h = mixer_and_input()
    out, _ = mixer(h)
    assert type(out.grad_fn).__name__ == "_GatedConvBackward"
    want_out = autograd_mixer(mixer, h)
    dout = torch.randn_like(out)
    params = [h, *mixer.parameters()]
    for got, want in zip(grads(out, params, dout), grads(want_out, params, dout)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(out, want_out)


def test_the_mixer_takes_the_one_pass_only_when_gradients_flow_and_generation_keeps_its_state(monkeypatch):
    import atma_titan.models.conv as conv

    calls = []
    monkeypatch.setattr(conv, "gated_conv_backward", lambda *a, **k: calls.append(k) or gated_conv_backward(*a, **k))
    mixer, h = mixer_and_input()
    with torch.no_grad():
        plain, _ = mixer(h)
    torch.testing.assert_close(plain, autograd_mixer(mixer, h).detach())
    mixer(h.detach())[0].sum().backward()  # weights only
    assert calls == [{"impl": "reference", "what": "model.conv_impl"}]
    mixer.requires_grad_(False)
    assert mixer(h.detach())[0].grad_fn is None and mixer(h)[0].grad_fn is not None

    class State:  # generation's conv state (atma_titan.inference): the last k - 1 inputs of each sequence
        def __init__(self):
            self.value = torch.zeros(3, 2, 24, dtype=torch.float64)

        def read(self):
            return self.value

        def write(self, x):
            self.value = x.detach().clone()

    class Cache:
        def __init__(self):
            self.conv = State()

        def state(self, name):
            return self.conv

    cache = Cache()
    first, _ = mixer(h[:, :6], cache)  # two chunks through the cache == the whole sequence
    second, _ = mixer(h[:, 6:], cache)
    torch.testing.assert_close(torch.cat([first, second], dim=1), plain)
    assert len(calls) == 1


def test_the_function_saves_only_its_inputs_and_in_projs_matmul_stays_outside_it():
    """As the MLP's Function (tests/kernels/test_glu.py): a compiled checkpoint does not tag ops inside an
    autograd.Function for recomputation, so the Function saves only inputs and in_proj's matmul runs outside."""
    mixer, h = mixer_and_input()
    out = mixer(h)[0]  # kept: torch 2.11 frees a Function's saved tensors with its output
    node = out.grad_fn
    u, in_bias, conv_weight, out_weight, doc_start = node.saved_tensors
    assert doc_start is None  # one document a sequence
    assert in_bias is mixer.in_proj.bias and conv_weight is mixer.conv.weight and out_weight is mixer.out_proj.weight
    torch.testing.assert_close(u, F.linear(h, mixer.in_proj.weight), rtol=0, atol=0)
    matmul = node.next_functions[0][0]
    assert "Mm" in type(matmul).__name__ or any("Mm" in type(f).__name__ for f, _ in matmul.next_functions)


def test_under_selective_ac_the_gradients_are_unchanged():
    mixer, h = mixer_and_input()
    dout = torch.randn(3, 11, 24, dtype=torch.float64)
    context = functools.partial(create_selective_checkpoint_contexts, selective_policy())
    out = checkpoint(lambda h: mixer(h)[0], h, use_reentrant=False, context_fn=context)
    params = [h, *mixer.parameters()]
    for a, b in zip(grads(out, params, dout), grads(autograd_mixer(mixer, h), params, dout)):
        torch.testing.assert_close(a, b)


def test_under_autocast_the_matmuls_run_in_bf16_and_gradients_keep_the_parameters_dtype():
    mixer, h = mixer_and_input(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = mixer(h)
        want_out = autograd_mixer(mixer, h)
    assert out.dtype == torch.bfloat16
    dout = torch.randn_like(out)
    params = [h, *mixer.parameters()]
    for a, b, p in zip(grads(out, params, dout), grads(want_out, params, dout), params):
        assert a.dtype == p.dtype == torch.float32
        assert (a - b).norm() <= 2e-2 * b.norm()  # bf16 matmuls both ways, rounded in other places


def test_auto_keeps_convolutions_wider_than_the_kernels_on_the_reference(monkeypatch):
    from atma_titan.kernels import backends
    from atma_titan.kernels.short_conv.ops import MAX_KERNEL

    monkeypatch.setattr(backends, "use_triton", lambda *a: pytest.fail("auto asked for the kernel"))
    u, do, weight = torch.randn(1, 4, 6), torch.randn(1, 4, 2), torch.randn(2, MAX_KERNEL + 1)
    for got, want in zip(gated_conv_backward(u, do, weight), gated_conv_backward_reference(u, do, weight)):
        torch.testing.assert_close(got, want)


def test_bad_shapes_are_refused_by_the_kernel_launcher():
    pytest.importorskip("triton")
    from atma_titan.kernels.short_conv.triton_short_conv import _check

    u, do, w = torch.zeros(2, 5, 12), torch.zeros(2, 5, 4), torch.zeros(4, 3)
    _check(u, do, w, None)
    with pytest.raises(ValueError, match="3 x channels"):
        _check(torch.zeros(2, 5, 11), do, w, None)
    with pytest.raises(ValueError, match=r"do \(2, 5, 3\) must be"):
        _check(u, torch.zeros(2, 5, 3), w, None)
    with pytest.raises(ValueError, match=r"weight \(3, 3\) must be"):
        _check(u, do, torch.zeros(3, 3), None)
    with pytest.raises(ValueError, match=r"kernel <= 4"):
        _check(u, do, torch.zeros(4, 5), None)
    with pytest.raises(ValueError, match=r"bias \(4,\) must be"):
        _check(u, do, w, torch.zeros(4))
    _check(u, do, w, None, torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"doc_start must have shape \(2, 5\)"):
        _check(u, do, w, None, torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="doc_start must be an integer tensor"):
        _check(u, do, w, None, torch.zeros(2, 5))


@pytest.mark.gpu
@needs_cuda
def test_bf16_on_the_gpu_matches_float64():
    torch.manual_seed(0)
    u = torch.randn(3, 2000, 3 * 1024, device="cuda").bfloat16()
    do = torch.randn(3, 2000, 1024, device="cuda").bfloat16()
    weight = torch.randn(1024, 3, device="cuda").bfloat16()
    bias = torch.randn(3 * 1024, device="cuda").bfloat16()
    want = gated_conv_backward_reference(u.double(), do.double(), weight.double(), bias.double())
    got = gated_conv_backward(u, do, weight, bias, impl="triton")
    # one bf16 rounding of dz and o; the sums in fp32 over 6,000 rows
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a.double(), b, rtol=2**-8, atol=1e-5)
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_the_compiled_mixer_under_selective_ac_on_the_gpu_has_autograds_gradients():
    mixer, h = mixer_and_input(dtype=torch.float32, device="cuda", impl="triton", d_model=64, seq_len=300)
    context = functools.partial(create_selective_checkpoint_contexts, selective_policy())
    step = torch.compile(lambda h: checkpoint(lambda h: mixer(h)[0], h, use_reentrant=False, context_fn=context))
    out = step(h)
    dout = torch.randn_like(out)
    params = [h, *mixer.parameters()]
    for a, b in zip(grads(out, params, dout), grads(autograd_mixer(mixer, h), params, dout)):
        # fp32 sums over 900 tokens in other orders: tolerances relative to each gradient's scale
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
