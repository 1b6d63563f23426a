"""The flash-linear-attention path (gated_delta_chunked_fla) without fla: a stand-in module in its place runs
our float64 recurrence per sequence with fla's documented conventions (state (N, H, Dk, Dv), r = scale *
S^T q, varlen through cu_seqlens over a batch of 1, one initial and one final state per sequence). The tests
check what we hand fla and what we make of its answer: the flattening, cu_seqlens, which document gets
which initial state, and the final state taken back."""

import sys
import types

import pytest
import torch
from documents import doc_start_from_lengths
from gated_delta_documents import PACKED_LENGTHS, assert_documents_apart
from helpers import F64, NAMES, outputs_and_grads, random_inputs

from atma_titan.kernels.gated_delta import gated_delta, gated_delta_chunked_fla
from atma_titan.kernels.gated_delta.reference import gated_delta_recurrent


class FakeFla(types.ModuleType):
    """fla.ops.gated_delta_rule with chunk_gated_delta_rule as fla documents it, each call recorded."""

    def __init__(self):
        super().__init__("fla.ops.gated_delta_rule")
        self.calls = []

    def chunk_gated_delta_rule(
        self,
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=None,
        head_first=False,
    ):
        self.calls.append({"q": q.shape, "cu_seqlens": cu_seqlens, "initial_state": initial_state, "scale": scale})
        if cu_seqlens is None:
            bounds = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
        else:
            if q.shape[0] != 1:
                raise ValueError("fla takes cu_seqlens with a batch of 1")
            ends = cu_seqlens.tolist()
            bounds = [(0, first, end) for first, end in zip(ends[:-1], ends[1:])]
        if initial_state is not None and initial_state.shape[0] != len(bounds):
            raise ValueError("fla wants one initial state per sequence")
        outputs, finals = [], []
        for n, (b, first, end) in enumerate(bounds):
            part = [x[b : b + 1, first:end] for x in (q, k, v, g, beta)]
            start = None if initial_state is None else initial_state[n : n + 1].transpose(-1, -2)
            r, state = gated_delta_recurrent(*part, initial_state=start, normalize_qk=use_qk_l2norm_in_kernel)
            outputs.append(scale * r)
            finals.append(state.transpose(-1, -2))
        o = torch.cat(outputs, dim=1 if cu_seqlens is not None else 0)
        return o, torch.cat(finals) if output_final_state else None


@pytest.fixture
def fake_fla(monkeypatch):
    fake = FakeFla()
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    return fake


def fla_inputs(**kwargs):
    """random_inputs whose log_gamma and initial state are exact in float32, as the fla path hands them to fla."""
    inputs = random_inputs(**kwargs)
    for name in ("log_gamma", "initial_state"):
        if inputs[name] is not None:
            inputs[name] = inputs[name].float().to(F64)
    return inputs


@pytest.mark.parametrize("with_initial_state", [True, False], ids=["init", "zeros"])
def test_fla_documents_match_each_document_alone(fake_fla, with_initial_state):
    inputs = fla_inputs(batch=3, seq_len=24, with_initial_state=with_initial_state, seed=60)
    # log_gamma reaches fla as float32, so its gradient comes back rounded to float32
    assert_documents_apart(gated_delta_chunked_fla, inputs, doc_start_from_lengths(PACKED_LENGTHS), tol=1e-6)


def test_fla_receives_the_flattened_batch_and_one_state_per_document(fake_fla):
    inputs = random_inputs(batch=3, seq_len=24, seed=61)
    gated_delta_chunked_fla(**inputs, doc_start=doc_start_from_lengths(PACKED_LENGTHS))
    (call,) = fake_fla.calls
    assert call["q"] == (1, 72, 3, 8) and call["scale"] == 1.0
    assert call["cu_seqlens"].dtype == torch.long
    assert call["cu_seqlens"].tolist() == [0, 8, 11, 12, 24, 25, 40, 48, 55, 71, 72]
    states = call["initial_state"]  # fla's layout (N, H, Dk, Dv): row b's state on its first document
    assert states.shape == (10, 3, 8, 6)
    for b, first in enumerate((0, 4, 7)):
        assert torch.equal(states[first], inputs["initial_state"][b].float().mT)
    assert not states[[1, 2, 3, 5, 6, 8, 9]].any()


def test_entry_point_hands_doc_start_to_fla(fake_fla):
    inputs = fla_inputs(batch=3, seq_len=24, seed=64)
    doc_start = doc_start_from_lengths(PACKED_LENGTHS)
    r, state = gated_delta(**inputs, impl="fla", doc_start=doc_start)
    assert fake_fla.calls[0]["cu_seqlens"] is not None
    r_ref, state_ref = gated_delta_recurrent(**inputs, doc_start=doc_start)
    torch.testing.assert_close(r, r_ref)
    torch.testing.assert_close(state, state_ref)


def test_fla_without_documents_keeps_the_batch(fake_fla):
    inputs = fla_inputs(batch=2, seq_len=9, seed=62)
    gen = torch.Generator().manual_seed(0)
    weights = (torch.randn(2, 9, 3, 6, generator=gen, dtype=F64), torch.randn(2, 3, 6, 8, generator=gen, dtype=F64))
    expected = outputs_and_grads(gated_delta_recurrent, inputs, *weights)
    actual = outputs_and_grads(gated_delta_chunked_fla, inputs, *weights)
    assert fake_fla.calls[0]["cu_seqlens"] is None and fake_fla.calls[0]["q"] == (2, 9, 3, 8)
    torch.testing.assert_close(actual[:2], expected[:2])
    for name in NAMES:
        torch.testing.assert_close(actual[2][name], expected[2][name], msg=name)


def test_fla_rejects_bad_doc_start(fake_fla):
    inputs = random_inputs(batch=2, seq_len=6, seed=63)
    with pytest.raises(ValueError, match="doc_start"):
        gated_delta_chunked_fla(**inputs, doc_start=torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="doc_start"):
        gated_delta_chunked_fla(**inputs, doc_start=torch.zeros(2, 6, dtype=torch.bool))
    assert not fake_fla.calls
