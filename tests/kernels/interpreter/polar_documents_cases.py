"""The fused Polar attention kernel over packed documents (doc_start), under the Triton interpreter (CPU).

Run by test_polar_documents.py (alone: see this folder's conftest.py). 16 x 16 tiles over T <= 64: documents
begin mid-tile, on a tile edge, are one token long (several in a row, and the last), or fill the window;
some tiles are fully visible inside a long document (the unmasked segments), GQA groups of 2 and 4, with and
without a window. The tile ranges themselves are read back from the kernels' own segment helpers, so a
kernel that only masked the tiles before a document (rather than skipping them) would fail here.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers import PARAM_NAMES, documents_alone, grads_of, make_inputs, random_cotangents
from documents import doc_start_from_starts

from atma_titan.kernels.documents import document_ends
from atma_titan.kernels.polar import polar_attention_triton
from atma_titan.kernels.polar import triton_attention as kernels
from atma_titan.kernels.polar.reference import polar_attention_naive, visibility_mask

T = 64
BLOCK = 16  # the interpreter's one tile configuration
# sequence 0: starts mid-tile (5, 35), on a tile edge (16), one-token documents in a row (16, 17) and last (63);
# sequence 1: one long document from position 7, so whole tiles are visible to whole query blocks
STARTS = ([5, 16, 17, 18, 35, 63], [7])
# (H, Hkv, window)
HEADS = {"gqa2": (4, 2, 0), "gqa4_window": (4, 1, 7)}


def as_float32(inputs):
    return [x.detach().float().requires_grad_() for x in inputs]


def assert_grads_close(actual, expected, rel, abs_floor, names=PARAM_NAMES):
    """Max error of each gradient against its counterpart, relative to that gradient's scale."""
    for name, a, e in zip(names, actual, expected):
        assert torch.isfinite(a).all(), name
        scale = e.abs().max().item()
        err = (a.double() - e.double()).abs().max().item()
        assert err <= rel * scale + abs_floor, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_documents_run_alone(heads):
    """Packed with doc_start: each document's c, mag and gradients as when it runs alone (doc_start=None),
    both through the kernel, and against the float64 materialised form."""
    h, hkv, window = heads
    inputs64 = make_inputs(2, T, T, h, hkv, 16, seed=31)
    inputs = as_float32(inputs64)
    doc_start = doc_start_from_starts(T, *STARTS)
    c, mag = polar_attention_triton(*inputs, window=window, doc_start=doc_start)
    g_c, g_mag = (g.float() for g in random_cotangents(c, mag, seed=32))
    c_alone, mag_alone, alone = documents_alone(polar_attention_triton, inputs, doc_start, g_c, g_mag, window=window)
    torch.testing.assert_close(c, c_alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mag, mag_alone, rtol=1e-5, atol=1e-6)
    packed = grads_of(polar_attention_triton, inputs, g_c, g_mag, window=window, doc_start=doc_start)
    assert_grads_close(packed, alone, rel=1e-5, abs_floor=1e-6)

    c_ref, mag_ref = polar_attention_naive(*inputs64, window=window, doc_start=doc_start)
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(mag.double(), mag_ref, rtol=1e-4, atol=2e-5)
    g_c, g_mag = g_c.double(), g_mag.double()
    expected = grads_of(polar_attention_naive, inputs64, g_c, g_mag, window=window, doc_start=doc_start)
    assert_grads_close(packed, expected, rel=1e-4, abs_floor=1e-5)


@pytest.mark.parametrize("split_mask", [True, False], ids=["split_mask", "one_masked_loop"])
def test_offset_queries_match_naive(split_mask):
    """Tq < Tk (the last 37 positions query; documents before them hold keys only), a window, and the
    SPLIT_MASK=False variant (one masked loop, an autotune choice on CUDA)."""
    tuned = (kernels.polar_fwd_kernel, kernels.polar_bwd_dq_kernel, kernels.polar_bwd_dkdv_kernel)
    assert all(len(k.configs) == 1 for k in tuned)  # the interpreter's single config, used as is
    inputs64 = make_inputs(2, 37, T, 4, 2, 16, seed=33)
    inputs = as_float32(inputs64)
    doc_start = doc_start_from_starts(T, *STARTS)
    try:
        for kernel in tuned:
            kernel.configs[0].kwargs["SPLIT_MASK"] = split_mask
        c, mag = polar_attention_triton(*inputs, window=9, doc_start=doc_start)
        g_c, g_mag = random_cotangents(c.double(), mag.double(), seed=34)
        actual = grads_of(polar_attention_triton, inputs, g_c.float(), g_mag.float(), window=9, doc_start=doc_start)
    finally:
        for kernel in tuned:
            kernel.configs[0].kwargs["SPLIT_MASK"] = True
    c_ref, mag_ref = polar_attention_naive(*inputs64, window=9, doc_start=doc_start)
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(mag.double(), mag_ref, rtol=1e-4, atol=2e-5)
    expected = grads_of(polar_attention_naive, inputs64, g_c, g_mag, window=9, doc_start=doc_start)
    assert_grads_close(actual, expected, rel=1e-4, abs_floor=1e-5)


def test_tiles_through_tensor_descriptors(monkeypatch):
    """Hopper's kernels (tiles by tensor descriptor) over packed documents: outputs and gradients against
    float64."""
    monkeypatch.setattr(kernels, "copy_engine", lambda device: True)
    inputs64 = make_inputs(2, T, T, 4, 2, 16, seed=35)
    inputs = as_float32(inputs64)
    doc_start = doc_start_from_starts(T, *STARTS)
    c, mag = polar_attention_triton(*inputs, window=7, doc_start=doc_start)
    c_ref, mag_ref = polar_attention_naive(*inputs64, window=7, doc_start=doc_start)
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(mag.double(), mag_ref, rtol=1e-4, atol=2e-5)
    g_c, g_mag = random_cotangents(c_ref, mag_ref, seed=36)
    actual = grads_of(polar_attention_triton, inputs, g_c.float(), g_mag.float(), window=7, doc_start=doc_start)
    expected = grads_of(polar_attention_naive, inputs64, g_c, g_mag, window=7, doc_start=doc_start)
    assert_grads_close(actual, expected, rel=1e-4, abs_floor=1e-5)


def test_one_document_is_no_documents():
    """doc_start all zero compiles the document variant, and gives bit for bit the doc_start=None results."""
    inputs = as_float32(make_inputs(2, 40, 40, 4, 2, 16, seed=35))
    one = torch.zeros(2, 40, dtype=torch.int32)
    with_docs = polar_attention_triton(*inputs, window=11, doc_start=one)
    without = polar_attention_triton(*inputs, window=11)
    assert all(torch.equal(a, b) for a, b in zip(with_docs, without))
    g_c, g_mag = (g.float() for g in random_cotangents(*without, seed=36))
    with_docs = grads_of(polar_attention_triton, inputs, g_c, g_mag, window=11, doc_start=one)
    without = grads_of(polar_attention_triton, inputs, g_c, g_mag, window=11)
    for name, a, b in zip(PARAM_NAMES, with_docs, without):
        assert torch.equal(a, b), name


def test_opcheck_with_documents():
    """The custom ops with a doc_start argument: schema, fakes, autograd registration."""
    inputs = make_inputs(1, 20, 24, 4, 2, 16, dtype=torch.float32, seed=37)
    doc_start = doc_start_from_starts(24, [3, 10, 11])
    fwd = torch.ops.atma.polar_attention_fwd.default
    torch.library.opcheck(fwd, (*inputs, 5, doc_start))
    outputs = fwd(*[x.detach() for x in inputs], 5, doc_start)
    g_c, g_mag = random_cotangents(outputs[0], outputs[1])
    args = (g_c, g_mag, *[x.detach() for x in inputs], outputs[0], *outputs[2:], 5, doc_start)
    torch.library.opcheck(torch.ops.atma.polar_attention_bwd.default, args)


def test_compiled_fullgraph_with_documents():
    """doc_start passes through a compiled graph without a break (CPU, aot_eager), with a backward."""
    torch._dynamo.reset()
    inputs64 = make_inputs(2, 24, 24, 4, 2, 16, seed=38)
    inputs = as_float32(inputs64)
    doc_start = doc_start_from_starts(24, [5, 6], [17])

    def loss_fn(fn, doc_start, *args):
        c, mag = fn(*args, window=10, doc_start=doc_start)
        return (c * c.flip(-1)).sum() + mag.square().sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    actual = torch.autograd.grad(compiled(polar_attention_triton, doc_start, *inputs), inputs)
    expected = torch.autograd.grad(loss_fn(polar_attention_naive, doc_start, *inputs64), inputs64)
    assert_grads_close(actual, expected, rel=1e-4, abs_floor=1e-5)


# ---------------------------------------------------------------------------------------------
# The tile ranges the kernels visit, read back from their own segment helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _key_ranges_probe(DOC_START, OUT, Tq, Tk, window, BLOCK_M: tl.constexpr, DOCUMENTS: tl.constexpr):
    """(lo, full_lo, full_hi, hi) of the forward / dq key loop of each query tile (one program each)."""
    start_m = tl.program_id(0) * BLOCK_M
    _, _, lo, full_lo, full_hi, hi = kernels._key_sweep(
        DOC_START, DOC_START, 0, 0, 0, 0, 0, 0, Tk - Tq, start_m, Tk, window, DOC_START, BLOCK_M, BLOCK_M, DOCUMENTS
    )
    out = OUT + tl.program_id(0) * 4
    tl.store(out, lo)
    tl.store(out + 1, full_lo)
    tl.store(out + 2, full_hi)
    tl.store(out + 3, hi)


@triton.jit
def _query_ranges_probe(DOC_END, OUT, Tq, Tk, window, BLOCK_N: tl.constexpr, DOCUMENTS: tl.constexpr):
    """(lo, full_lo, full_hi, hi) of the dk/dv query loop of each key tile (one program each)."""
    start_n = tl.program_id(0) * BLOCK_N
    lo, full_lo, full_hi, hi = kernels._query_sweep(DOC_END, start_n, Tq, Tk, window, BLOCK_N, BLOCK_N, DOCUMENTS)
    out = OUT + tl.program_id(0) * 4
    tl.store(out, lo)
    tl.store(out + 1, full_lo)
    tl.store(out + 2, full_hi)
    tl.store(out + 3, hi)


def segment_tiles(lo, full_lo, full_hi, hi):
    """The (masked, unmasked) tile starts the kernels' three loops visit, as the kernels run them."""
    masked = [*range(lo, min(full_lo, hi), BLOCK), *range(max(full_lo, full_hi), hi, BLOCK)]
    return masked, list(range(full_lo, full_hi, BLOCK))


def tile_ranges(doc_start, tq, window):
    """Per query tile and per key tile: (masked, unmasked) visited tile starts; doc_start (Tk,) or None."""
    tk = T
    documents = doc_start is not None
    starts = doc_start[None].int().contiguous() if documents else torch.zeros(1, tk, dtype=torch.int32)
    ends = document_ends(starts).contiguous()
    key_out = torch.zeros(triton.cdiv(tq, BLOCK), 4, dtype=torch.int32)
    query_out = torch.zeros(triton.cdiv(tk, BLOCK), 4, dtype=torch.int32)
    _key_ranges_probe[(key_out.shape[0],)](starts, key_out, tq, tk, window, BLOCK_M=BLOCK, DOCUMENTS=documents)
    _query_ranges_probe[(query_out.shape[0],)](ends, query_out, tq, tk, window, BLOCK_N=BLOCK, DOCUMENTS=documents)
    return [segment_tiles(*r) for r in key_out.tolist()], [segment_tiles(*r) for r in query_out.tolist()]


def visible(doc_start, tq, window):
    """(Tq, Tk) bool: which key each query sees (the references' own mask)."""
    q_pos = torch.arange(T - tq, T)
    first = None if doc_start is None else doc_start.long()[q_pos]
    return visibility_mask(q_pos, torch.arange(T), window, first)


LAYOUTS = {
    "one_document": None,
    "packed": doc_start_from_starts(T, STARTS[0])[0],
    "documents_of_8": doc_start_from_starts(T, range(0, T, 8))[0],
    "documents_of_3": doc_start_from_starts(T, range(0, T, 3))[0],
}


@pytest.mark.parametrize(("tq", "window"), [(T, 0), (T, 7), (50, 0), (50, 21)])
@pytest.mark.parametrize("layout", LAYOUTS.keys())
def test_tile_ranges_are_the_visible_tiles(layout, tq, window):
    """Each query tile's key loop visits exactly the key tiles from the first to the last one holding a
    visible key, each once, and its unmasked tiles are wholly visible to every row; likewise each key
    tile's query loop over the query tiles (dk/dv)."""
    doc_start = LAYOUTS[layout]
    vis = visible(doc_start, tq, window)
    key_ranges, query_ranges = tile_ranges(doc_start, tq, window)

    def check(tiles, seen, full_block):
        masked, full = tiles
        visited = sorted(masked + full)
        assert len(set(visited)) == len(visited), visited  # no tile twice
        needed = sorted({(i // BLOCK) * BLOCK for i in torch.nonzero(seen).flatten().tolist()})
        expected = list(range(needed[0], needed[-1] + 1, BLOCK)) if needed else []
        assert visited == expected
        for start in full:
            assert full_block(start).all(), start

    for m, tiles in enumerate(key_ranges):
        rows = slice(m * BLOCK, min((m + 1) * BLOCK, tq))
        check(tiles, vis[rows].any(0), lambda n, rows=rows: vis[rows, n : n + BLOCK])
    for n, tiles in enumerate(query_ranges):
        keys = slice(n * BLOCK, min((n + 1) * BLOCK, T))
        check(tiles, vis[:, keys].any(1), lambda m, keys=keys: vis[m : min(m + BLOCK, tq), keys])


def test_short_documents_visit_fewer_tiles():
    """Skipping, not only masking: a window of 8-token documents visits one key tile per query tile and one
    query tile per key tile, where one document over the window visits m + 1 and (4 - n)."""

    def counts(doc_start):
        key_ranges, query_ranges = tile_ranges(doc_start, T, 0)
        return [sum(map(len, r)) for r in key_ranges], [sum(map(len, r)) for r in query_ranges]

    assert counts(None) == counts(torch.zeros(T, dtype=torch.int32)) == ([1, 2, 3, 4], [4, 3, 2, 1])
    assert counts(LAYOUTS["documents_of_8"]) == ([1, 1, 1, 1], [1, 1, 1, 1])
