"""Polar attention over packed documents (doc_start): each document reads as if it ran alone.

The defining property: a packed window with doc_start gives, for every document, the c, mag and
gradients (q, k, v and the five per-head parameters) of that document run alone with doc_start=None,
for the materialised and the streaming references (the fused kernel's cases are in
tests/kernels/interpreter/polar_documents_cases.py). Documents begin at position 0, mid-tile, are one
token long, several one-token documents in a row, or fill the whole window.
"""

import pytest
import torch
from documents import doc_start_from_starts
from helpers import (
    PARAM_NAMES,
    documents_alone,
    grads_of,
    make_inputs,
    random_cotangents,
    run_interpreter_cases,
)

from atma_titan.kernels.polar import (
    polar_attention,
    polar_attention_naive,
    polar_attention_reference,
    polar_attention_triton,
)
from atma_titan.kernels.polar.reference import _key_blocks, _Layout, visible_key_counts

T = 37
# sequence 0: mid-tile starts, three one-token documents in a row (16, 17, 18) and one at the end;
# sequence 1: two documents
STARTS = ([5, 16, 17, 18, 27, 36], [20])
# (H, Hkv, window)
HEADS = {
    "gqa2": (4, 2, 0),
    "gqa4_window": (4, 1, 6),
    "mha_window_above_documents": (2, 2, 13),
}
# (block_q, block_k): documents begin mid-tile, tiles hold several documents
BLOCKS = [(8, 8), (5, 3)]


def assert_close_named(actual, expected, names=PARAM_NAMES, **tol):
    for name, a, e in zip(names, actual, expected):
        torch.testing.assert_close(a, e, msg=lambda m, n=name: f"{n}: {m}", **tol)


def check_documents_alone(fn, h, hkv, window, tq=T, seed=0, **kw):
    """fn with doc_start against each document run alone through fn, forward and every gradient."""
    inputs = make_inputs(2, tq, T, h, hkv, 8, seed=seed)
    doc_start = doc_start_from_starts(T, *STARTS)
    c, mag = fn(*inputs, window=window, doc_start=doc_start, **kw)
    g_c, g_mag = random_cotangents(c, mag, seed=seed + 1)
    c_alone, mag_alone, expected = documents_alone(fn, inputs, doc_start, g_c, g_mag, window=window, **kw)
    torch.testing.assert_close(c, c_alone, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mag, mag_alone, rtol=1e-10, atol=1e-12)
    actual = grads_of(fn, inputs, g_c, g_mag, window=window, doc_start=doc_start, **kw)
    assert_close_named(actual, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_naive_documents_run_alone(heads):
    check_documents_alone(polar_attention_naive, *heads, seed=1)


@pytest.mark.parametrize("blocks", BLOCKS, ids=["block8", "block5x3"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_streaming_documents_run_alone(heads, blocks):
    check_documents_alone(polar_attention_reference, *heads, seed=2, block_q=blocks[0], block_k=blocks[1])


@pytest.mark.parametrize("window", [0, 6])
def test_offset_queries_documents_run_alone(window):
    """Tq < Tk: the queries are the last 15 positions; the documents before them only hold keys."""
    check_documents_alone(polar_attention_naive, 4, 2, window, tq=15, seed=3)
    check_documents_alone(polar_attention_reference, 4, 2, window, tq=15, seed=3, block_q=4, block_k=8)


@pytest.mark.parametrize(("tq", "window", "blocks"), [(T, 0, (8, 8)), (T, 9, (6, 4)), (20, 5, (8, 16))])
def test_streaming_matches_naive_with_documents(tq, window, blocks):
    inputs = make_inputs(2, tq, T, 4, 1, 8, seed=4)
    doc_start = doc_start_from_starts(T, *STARTS)
    kw = dict(window=window, doc_start=doc_start, block_q=blocks[0], block_k=blocks[1])
    c_ref, mag_ref = polar_attention_naive(*inputs, window=window, doc_start=doc_start)
    c, mag = polar_attention_reference(*inputs, **kw)
    torch.testing.assert_close(c, c_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mag, mag_ref, rtol=1e-10, atol=1e-12)
    g_c, g_mag = random_cotangents(c_ref, mag_ref)
    expected = grads_of(polar_attention_naive, inputs, g_c, g_mag, window=window, doc_start=doc_start)
    actual = grads_of(polar_attention_reference, inputs, g_c, g_mag, **kw)
    assert_close_named(actual, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("window", [0, 6])
def test_one_document_is_no_documents(window):
    """doc_start all zero is the window as one document: exactly the doc_start=None numbers (the per-head
    parameters' gradients up to the order of their sums: per (batch, query) terms are summed differently)."""
    inputs = make_inputs(2, 30, 30, 4, 2, 8, seed=5)
    one = torch.zeros(2, 30, dtype=torch.int32)
    g_c, g_mag = random_cotangents(*polar_attention_naive(*inputs, window=window))
    for fn, kw in ((polar_attention_naive, {}), (polar_attention_reference, dict(block_q=8, block_k=8))):
        kw = dict(window=window, **kw)
        for with_docs, without in zip(fn(*inputs, doc_start=one, **kw), fn(*inputs, **kw)):
            assert torch.equal(with_docs, without), fn.__name__
        with_docs = grads_of(fn, inputs, g_c, g_mag, doc_start=one, **kw)
        without = grads_of(fn, inputs, g_c, g_mag, **kw)
        for name, a, e in zip(PARAM_NAMES[:3], with_docs[:3], without[:3]):
            assert torch.equal(a, e), f"{fn.__name__}: {name}"
        assert_close_named(with_docs[3:], without[3:], PARAM_NAMES[3:], rtol=1e-13, atol=1e-13)


def test_visible_key_counts_per_document():
    doc_start = doc_start_from_starts(8, [3, 4], [])
    # queries at positions 2..7; sequence 0's documents begin at 0, 3 and 4
    assert visible_key_counts(6, 8, doc_start=doc_start).tolist() == [[3, 1, 1, 2, 3, 4], [3, 4, 5, 6, 7, 8]]
    assert visible_key_counts(6, 8, window=3, doc_start=doc_start).tolist() == [[3, 1, 1, 2, 3, 3], [3] * 6]
    assert visible_key_counts(6, 8, window=3).tolist() == [3] * 6  # without documents: one row for the batch


def visited_tiles(layout: _Layout, block_q: int, block_k: int) -> int:
    return sum(len(list(layout.key_blocks(lo, min(lo + block_q, layout.tq), block_k))) for lo in range(0, T, block_q))


def test_key_tiles_before_the_document_are_skipped():
    """Tiles are skipped, not only masked: a window of short documents visits fewer key tiles."""
    # the tile range of one query block: from the tile of its first row's document start
    assert [lo for lo, _ in _key_blocks(40, 47, 0, 8)] == [0, 8, 16, 24, 32, 40]
    assert [lo for lo, _ in _key_blocks(40, 47, 0, 8, doc_first=37)] == [32, 40]
    assert [lo for lo, _ in _key_blocks(40, 47, 12, 8, doc_first=20)] == [24, 32, 40]  # the window is later
    q, k = make_inputs(2, T, T, 2, 1, 8, requires_grad=False)[:2]
    short = _Layout(q, k, 0, torch.float64, doc_start_from_starts(T, range(0, T, 6), range(0, T, 6)))
    whole = _Layout(q, k, 0, torch.float64, torch.zeros(2, T, dtype=torch.int32))
    assert visited_tiles(whole, 8, 8) == visited_tiles(_Layout(q, k, 0, torch.float64), 8, 8) == 15
    # documents of 6 tokens: each query block of 8 reaches back one tile at most (1 + 2 + 2 + 1 + 2)
    assert visited_tiles(short, 8, 8) == 8
    # the batch shares the streaming reference's tiles: the earliest start of the two sequences bounds them
    mixed = _Layout(q, k, 0, torch.float64, doc_start_from_starts(T, range(0, T, 6), []))
    assert visited_tiles(mixed, 8, 8) == 15


def test_gradcheck_with_documents():
    inputs = make_inputs(1, 7, 7, 2, 1, 3, seed=6)
    doc_start = doc_start_from_starts(7, [2, 3])
    assert torch.autograd.gradcheck(
        lambda *x: polar_attention_reference(*x, window=3, doc_start=doc_start, block_q=2, block_k=3),
        inputs,
        eps=1e-6,
        atol=1e-6,
    )


def test_streaming_compiles_with_documents():
    """fullgraph: the compiled reference reads no document start on the host (it masks, skipping no tile)."""
    torch._dynamo.reset()
    inputs = make_inputs(2, T, T, 4, 2, 8, seed=8)
    doc_start = doc_start_from_starts(T, *STARTS)

    def loss_fn(fn, doc_start, *args, **kw):
        c, mag = fn(*args, window=6, doc_start=doc_start, **kw)
        return (c * c.flip(-1)).sum() + mag.square().sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    actual = torch.autograd.grad(compiled(polar_attention_reference, doc_start, *inputs, block_q=8, block_k=8), inputs)
    expected = torch.autograd.grad(loss_fn(polar_attention_naive, doc_start, *inputs), inputs)
    assert_close_named(actual, expected, rtol=1e-9, atol=1e-11)


def test_dispatch_passes_documents():
    inputs = make_inputs(2, T, T, 4, 2, 8, seed=7, requires_grad=False)
    doc_start = doc_start_from_starts(T, *STARTS)
    expected = polar_attention_naive(*inputs, window=5, doc_start=doc_start)
    actual = polar_attention(*inputs, window=5, doc_start=doc_start, impl="reference", block_q=8, block_k=8)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


BAD_DOC_STARTS = {  # for Tq = 4 queries over Tk = 6 keys in a batch of 2
    "indexed_by_query": torch.zeros(2, 4, dtype=torch.int32),
    "one_row": torch.zeros(1, 6, dtype=torch.int32),
    "float": torch.zeros(2, 6),
    "bool": torch.zeros(2, 6, dtype=torch.bool),
}


@pytest.mark.parametrize("doc_start", BAD_DOC_STARTS.values(), ids=BAD_DOC_STARTS.keys())
@pytest.mark.parametrize(
    "fn", [polar_attention_naive, polar_attention_reference, polar_attention_triton, polar_attention]
)
def test_rejects_bad_doc_start(fn, doc_start):
    inputs = make_inputs(2, 4, 6, 2, 1, 16, dtype=torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="doc_start"):
        fn(*inputs, doc_start=doc_start)


@pytest.mark.slow
def test_interpreter_cases():
    run_interpreter_cases("polar_documents_cases.py")
