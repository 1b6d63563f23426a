"""Packed documents for the gated delta rule's tests (tests/kernels/test_gated_delta_reference.py,
tests/kernels/interpreter/gated_delta_triton_cases.py): the property that defines doc_start. A packed
window run with doc_start must give, for each of its documents, the r and the gradients of that document
run alone from a zero state (a row's first document from the row's initial state), and the final state of
the row's last document."""

import torch
from documents import document_spans
from helpers import F64, NAMES, assert_relative_close, cast, outputs_and_grads

from atma_titan.kernels.gated_delta.reference import gated_delta_recurrent

# Document lengths per row, T = 24: resets at a chunk start (8 and 16 for chunks of 4 or 8; [16, 24) holds
# no other), mid-chunk, at position 1, several in one chunk, length-1 documents (first, middle, last) and
# at a chunk's last row (7).
PACKED_LENGTHS = [[8, 3, 1, 12], [1, 15, 8], [7, 16, 1]]


def each_document_alone(inputs, doc_start, r_weight, state_weight, **kwargs):
    """(r, final_state, {name: grad}) of the float64 recurrence run on each document alone, put back in
    place; loss = <r, r_weight> + <final_state, state_weight> as helpers.outputs_and_grads has it."""
    leaves = {name: x.detach().to(F64).requires_grad_(True) for name, x in inputs.items() if x is not None}
    initial_state = leaves.get("initial_state")
    r = torch.empty(inputs["v"].shape, dtype=F64)
    final_state = torch.empty(state_weight.shape, dtype=F64)
    loss = 0.0
    for b, row in enumerate(document_spans(doc_start)):
        for first, end in row:
            part = {name: leaves[name][b : b + 1, first:end] for name in NAMES[:5]}
            start = initial_state[b : b + 1] if first == 0 and initial_state is not None else None
            r_doc, state = gated_delta_recurrent(**part, initial_state=start, **kwargs)
            loss = loss + (r_doc * r_weight[b : b + 1, first:end]).sum()
            r[b, first:end] = r_doc[0].detach()
        loss = loss + (state * state_weight[b : b + 1]).sum()  # the state after the row's last document
        final_state[b] = state[0].detach()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return r, final_state, dict(zip(leaves, grads))


def assert_documents_apart(fn, inputs, doc_start, tol, dtype=F64, seed=1, **kwargs):
    """fn(..., doc_start=doc_start) on inputs rounded to dtype against each document run alone in float64 on
    the same rounded values: r, final state and every gradient (initial_state's included)."""
    low = inputs if dtype == F64 else cast(inputs, dtype)
    gen = torch.Generator().manual_seed(seed)
    batch, _, heads, value_dim = inputs["v"].shape
    r_weight = torch.randn(inputs["v"].shape, generator=gen, dtype=F64)
    state_weight = torch.randn(batch, heads, value_dim, inputs["k"].shape[-1], generator=gen, dtype=F64)
    r, state, grads = outputs_and_grads(fn, low, r_weight, state_weight, doc_start=doc_start, **kwargs)
    r_alone, state_alone, grads_alone = each_document_alone(low, doc_start, r_weight, state_weight, **kwargs)
    assert_relative_close(r, r_alone, tol, "r")
    assert_relative_close(state, state_alone, tol, "final_state")
    assert set(grads) == set(grads_alone)
    for name, expected in grads_alone.items():
        assert_relative_close(grads[name], expected, tol, f"d{name}")
    return grads
