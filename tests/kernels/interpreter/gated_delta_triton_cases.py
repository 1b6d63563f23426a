"""Gated delta Triton kernels under the Triton interpreter (CPU), against float64 references.

Run by test_gated_delta_triton.py (alone: see this folder's conftest.py). Shapes are tiny (the interpreter
runs every program in Python); Dv = 32 with the interpreter's Dv block of 16 covers several Dv blocks, T = 70
and 130 cover ragged tail chunks. Packed documents (doc_start) are checked against each document run alone.

Every kernel launched here runs under tests/support/interpreter_bounds.py (the interpreter itself reads and
writes host memory unchecked): each masked-in address of every tl.load / tl.store must lie inside one of
the launch's tensor arguments. The GPU's own block sizes (BV from triton_chunked.GPU_BLOCK_VALUES, BK and
the prepare kernel's Dv block padded to triton_chunked.MIN_DOT_BLOCK = 64) are run too, at Dk != Dv,
Dv < BV and BV not dividing Dv, which the interpreter's default first config (BV = 16) never reaches.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from documents import doc_start_from_lengths
from gated_delta_documents import assert_documents_apart
from helpers import (
    F64,
    NAMES,
    assert_relative_close,
    cast,
    compare_to_float64,
    exact_step,
    random_inputs,
    random_step,
)
from interpreter_bounds import interpreter_bounds_check

from atma_titan.kernels.documents import document_resets
from atma_titan.kernels.gated_delta import gated_delta_chunked_triton, gated_delta_step_
from atma_titan.kernels.gated_delta.reference import gated_delta_step_inplace


@pytest.fixture(autouse=True)
def _bounds_checked():
    with interpreter_bounds_check():
        yield


# ---------------------------------------------------------------------------------------------
# Chunked kernels: outputs, final state and every gradient against the float64 recurrence

CHUNKED_CASES = [
    # (seq_len, key_dim, value_dim, dtype, with_initial_state)
    (70, 16, 32, torch.float32, True),  # ragged tail, two Dv blocks
    (70, 16, 32, torch.float32, False),
    (64, 24, 16, torch.float32, True),  # exact chunk, Dk not a power of two
    (1, 16, 16, torch.float32, False),  # one token
    (130, 16, 16, torch.float16, True),  # three chunks in half precision
]


@pytest.mark.parametrize("seq_len,key_dim,value_dim,dtype,with_initial_state", CHUNKED_CASES)
def test_chunked_kernel_matches_float64_recurrence(seq_len, key_dim, value_dim, dtype, with_initial_state):
    inputs = random_inputs(1, seq_len, 2, key_dim, value_dim, with_initial_state=with_initial_state, seed=seq_len)
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    compare_to_float64(gated_delta_chunked_triton, inputs, dtype, tol)


def test_chunked_kernel_without_normalisation():
    inputs = random_inputs(1, 70, 2, 16, 16, seed=4)
    inputs["q"] = 0.3 * inputs["q"]
    inputs["k"] = F.normalize(inputs["k"], dim=-1) * 0.9  # keeps I - beta k k^T a contraction
    compare_to_float64(gated_delta_chunked_triton, inputs, torch.float32, 2e-5, normalize_qk=False)
    # the flag reaches the kernels: normalising would change the result
    args = {name: inputs[name].float() for name in NAMES}
    r_plain, _ = gated_delta_chunked_triton(**args, normalize_qk=False)
    r_normalised, _ = gated_delta_chunked_triton(**args, normalize_qk=True)
    assert (r_plain - r_normalised).abs().max() > 1e-2


def test_chunked_kernel_extreme_gates_stay_finite():
    """gamma down to e^-30 (decays underflow inside a chunk), beta near 0 and 1, tiny keys (norm < eps)."""
    inputs = random_inputs(1, 70, 2, 16, 16, seed=5)
    gen = torch.Generator().manual_seed(5)
    inputs["log_gamma"] = -30.0 * torch.rand(1, 70, 2, generator=gen, dtype=F64) ** 4
    inputs["beta"] = torch.where(torch.rand(1, 70, 2, generator=gen) < 0.5, 1e-4, 1 - 1e-4).to(F64)
    inputs["k"][0, 3] = 1e-8  # below the normalisation's eps
    compare_to_float64(gated_delta_chunked_triton, inputs, torch.float32, 1e-4)


def test_chunked_kernel_on_empty_sequence_returns_initial_state():
    inputs = cast(random_inputs(1, 0, 2, 16, 16), torch.float32)
    r, state = gated_delta_chunked_triton(**inputs)
    assert r.shape == (1, 0, 2, 16)
    torch.testing.assert_close(state, inputs["initial_state"])


# ---------------------------------------------------------------------------------------------
# Documents: the state is zeroed before each document start (doc_start)

DOCUMENT_CASES = [
    # (document lengths per row, with_initial_state); the kernel's chunk is 64
    # resets at a chunk start (64), at 67 and 68 (two in one chunk, a length-1 document) and at 1; row 1's
    # second chunk starts with a reset and holds no other
    ([[64, 3, 1, 60], [1, 63, 64]], True),
    # a reset on a chunk's last row (63) and a length-1 document at the sequence's end, in a ragged tail
    ([[20, 43, 6, 1]], False),
]


@pytest.mark.parametrize("lengths,with_initial_state", DOCUMENT_CASES)
def test_packed_documents_match_each_document_alone(lengths, with_initial_state):
    doc_start = doc_start_from_lengths(lengths)
    batch, seq_len = doc_start.shape
    inputs = random_inputs(batch, seq_len, 2, 16, 16, with_initial_state=with_initial_state, seed=seq_len)
    assert_documents_apart(gated_delta_chunked_triton, inputs, doc_start, 2e-5, dtype=torch.float32)


def test_documents_in_half_precision_match_the_float64_recurrence():
    doc_start = doc_start_from_lengths([[64, 3, 1, 60]])
    inputs = random_inputs(1, 128, 2, 16, 16, seed=9)
    compare_to_float64(gated_delta_chunked_triton, inputs, torch.float16, 4e-3, doc_start=doc_start.long())


def test_reset_gradient_and_one_document_window():
    """The resets' log_gamma gradient is exactly zero; doc_start all zero gives exactly the doc_start=None
    numbers (outputs and every gradient)."""
    inputs = cast(random_inputs(2, 70, 2, 16, 16, seed=10), torch.float32)
    leaves = [x.requires_grad_(True) for x in inputs.values()]
    doc_starts = {
        "none": None,
        "one": torch.zeros(2, 70, dtype=torch.int32),
        "packed": doc_start_from_lengths([[64, 1, 5], [30, 40]]),
    }
    results = {}
    for name, doc_start in doc_starts.items():
        r, state = gated_delta_chunked_triton(**inputs, doc_start=doc_start)
        grads = torch.autograd.grad((r * r.detach().cos()).sum() + state.square().sum(), leaves)
        results[name] = (r, state, *grads)
    for plain, one_document in zip(results["none"], results["one"]):
        assert torch.equal(plain, one_document)
    dlog_gamma = results["packed"][2 + NAMES.index("log_gamma")]
    resets = document_resets(doc_starts["packed"])
    assert torch.equal(dlog_gamma[resets], torch.zeros_like(dlog_gamma[resets]))
    assert (dlog_gamma[~resets] != 0).all()


def test_rejects_bad_doc_start():
    inputs = cast(random_inputs(1, 5, 1, 16, 16), torch.float32)
    with pytest.raises(ValueError, match="doc_start"):
        gated_delta_chunked_triton(**inputs, doc_start=torch.zeros(1, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="doc_start"):
        gated_delta_chunked_triton(**inputs, doc_start=torch.zeros(1, 5))


# ---------------------------------------------------------------------------------------------
# The GPU's block sizes under the interpreter


def _gpu_block_choices():
    """One (sequential, parallel, grad) BV triple per position of the longest GPU list."""
    from atma_titan.kernels.gated_delta.triton_chunked import GPU_BLOCK_VALUES as bvs

    longest = max(len(v) for v in bvs.values())
    return [
        tuple(bvs[kind][min(i, len(bvs[kind]) - 1)] for kind in ("sequential", "parallel", "grad"))
        for i in range(longest)
    ]


def _chunked_module():
    from atma_titan.kernels.gated_delta import triton_chunked

    return triton_chunked


def test_bounds_check_catches_an_out_of_bounds_access():
    """The bounds check is live: a load one element past a tensor fails, the same load masked passes."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(x_ptr, y_ptr, N: tl.constexpr, B: tl.constexpr):
        i = tl.arange(0, B)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < N), mask=i < 8)

    x, y = torch.arange(8.0), torch.empty(8)
    copy[(1,)](x, y, N=8, B=16)
    assert torch.equal(x, y)
    with pytest.raises(Exception, match="out-of-bounds tl.load"):
        copy[(1,)](x, y, N=9, B=16)


GPU_BLOCK_CASES = [
    # (seq_len, key_dim, value_dim, dtype, with_initial_state)
    (70, 24, 80, torch.float32, True),  # Dk < BK = 64; Dv = 80: BV 64 leaves a partial block, BV 128 > Dv
    (130, 64, 32, torch.float32, False),  # Dk != Dv, Dv < every BV, three chunks
    (64, 16, 16, torch.float16, True),  # half precision, both dims far below the blocks
]


@pytest.mark.parametrize("blocks", _gpu_block_choices())
@pytest.mark.parametrize("seq_len,key_dim,value_dim,dtype,with_initial_state", GPU_BLOCK_CASES)
def test_chunked_kernel_with_gpu_blocks(monkeypatch, blocks, seq_len, key_dim, value_dim, dtype, with_initial_state):
    import triton

    chunked = _chunked_module()
    monkeypatch.setattr(chunked, "MIN_DOT_BLOCK", 64)
    bv_sequential, bv_parallel, bv_grad = blocks
    for kernel, bv in (
        (chunked._state_fwd_kernel, bv_sequential),
        (chunked._state_bwd_kernel, bv_sequential),
        (chunked._output_kernel, bv_parallel),
        (chunked._dv_local_kernel, bv_parallel),
        (chunked._grad_transform_kernel, bv_grad),
        (chunked._grad_output_kernel, bv_grad),
    ):
        monkeypatch.setattr(kernel, "configs", [triton.Config({"BV": bv}, num_warps=4, num_stages=2)])
        monkeypatch.setattr(kernel, "cache", {})
    inputs = random_inputs(1, seq_len, 2, key_dim, value_dim, with_initial_state=with_initial_state, seed=seq_len)
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    compare_to_float64(gated_delta_chunked_triton, inputs, dtype, tol)


# ---------------------------------------------------------------------------------------------
# Decode step


@pytest.mark.parametrize("use_kernel", [True, False], ids=["triton", "pytorch"])
def test_step_updates_only_addressed_slots_in_place(use_kernel):
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(6, 2, 48, 24, generator=gen)  # Dv 48 = 2 row blocks of 32 (one partial); Dk 24 masked
    before = pool.clone()
    address = pool.data_ptr()
    slots = torch.tensor([4, 1, 2])
    token = random_step(3, 2, 24, 48, seed=1)
    step = gated_delta_step_ if use_kernel else gated_delta_step_inplace
    r = step(pool, slots, **token)

    r_ref, new_ref = exact_step(before[slots], token)
    assert pool.data_ptr() == address
    assert_relative_close(r, r_ref, 1e-5, "r")
    assert_relative_close(pool[slots], new_ref, 1e-5, "updated slots")
    untouched = [i for i in range(6) if i not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_prefill_then_decode_equals_one_chunked_pass():
    """Chunked kernel over 70 tokens, then 5 decode steps on a pool == one chunked pass over 75."""
    total, prefill = 75, 70
    inputs = cast(random_inputs(2, total, 2, 16, 32, seed=8), torch.float32)
    r_full, state_full = gated_delta_chunked_triton(**inputs)
    head = {name: x if name == "initial_state" else x[:, :prefill] for name, x in inputs.items()}
    r_prefill, state = gated_delta_chunked_triton(**head)

    pool = torch.zeros(4, 2, 32, 16)
    slots = torch.tensor([3, 0])
    pool[slots] = state
    decoded = []
    for t in range(prefill, total):
        token = {name: inputs[name][:, t] for name in ("q", "k", "v", "log_gamma", "beta")}
        decoded.append(gated_delta_step_(pool, slots, **token))
    torch.testing.assert_close(r_prefill, r_full[:, :prefill], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(decoded, dim=1), r_full[:, prefill:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[slots], state_full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# torch.library registration


@pytest.mark.parametrize("with_documents", [False, True], ids=["one", "documents"])
@pytest.mark.parametrize("with_initial_state", [True, False], ids=["init", "zeros"])
def test_chunked_op_passes_opcheck(with_initial_state, with_documents):
    inputs = cast(random_inputs(1, 20, 1, 16, 16, with_initial_state=with_initial_state, seed=2), torch.float32)
    args = tuple(inputs[name] for name in NAMES)
    for x in args:
        if x is not None:
            x.requires_grad_(True)
    doc_start = doc_start_from_lengths([[7, 13]]) if with_documents else None
    torch.library.opcheck(torch.ops.atma.gated_delta_chunk_fwd, (*args, True, True, doc_start))


def test_backward_reuses_the_forward_workspaces():
    """A forward with gradients keeps its workspaces; the backward runs neither of the forward's
    workspace kernels again. Without gradients the workspaces come back empty."""
    from atma_titan.kernels.gated_delta import triton_chunked

    inputs = cast(random_inputs(1, 70, 2, 16, 32, with_initial_state=True, seed=4), torch.float32)
    launched = []

    class Counting:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    names = ["_prepare_kernel", "_state_fwd_kernel", "_output_kernel", "_grad_transform_kernel"]
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(triton_chunked, name, Counting(name, getattr(triton_chunked, name))))
        with torch.no_grad():
            _, _, *empty = torch.ops.atma.gated_delta_chunk_fwd(*inputs.values(), True, False)
        assert all(w.numel() == 0 for w in empty) and len(empty) == len(triton_chunked.WORKSPACES)
        launched.clear()
        args = {name: x.requires_grad_(True) for name, x in inputs.items()}
        r, state = gated_delta_chunked_triton(**args)
        (r.square().sum() + state.sum()).backward()
    assert launched == names, launched  # one prepare and one state pass: the forward's
    assert all(x.grad is not None for x in args.values())

    # the op called directly without its workspaces refuses a backward instead of recomputing them
    r, *_ = torch.ops.atma.gated_delta_chunk_fwd(*args.values(), True, False)
    with pytest.raises(RuntimeError, match="keep_workspaces=False"):
        r.sum().backward()


def test_step_op_passes_opcheck():
    pool = torch.randn(3, 1, 16, 16)
    token = random_step(2, 1, 16, 16, seed=3)
    torch.library.opcheck(
        torch.ops.atma.gated_delta_step,
        (pool, torch.tensor([2, 0]), *token.values(), True),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("with_documents", [False, True], ids=["one", "documents"])
def test_compiles_with_fullgraph_and_backward_on_cpu(with_documents):
    inputs = cast(random_inputs(1, 20, 1, 16, 16, seed=6), torch.float32)
    for x in inputs.values():
        x.requires_grad_(True)
    doc_start = doc_start_from_lengths([[7, 13]]) if with_documents else None

    def memory(q, k, v, log_gamma, beta, initial_state):
        r, state = gated_delta_chunked_triton(
            q, k, v, log_gamma, beta.sigmoid(), initial_state=initial_state, doc_start=doc_start
        )
        return (r * 2).sum() + state.square().sum()

    compiled = torch.compile(memory, fullgraph=True, backend="inductor")
    loss = compiled(*inputs.values())
    grads = torch.autograd.grad(loss, list(inputs.values()))
    loss_eager = memory(*inputs.values())
    grads_eager = torch.autograd.grad(loss_eager, list(inputs.values()))
    torch.testing.assert_close(loss, loss_eager)
    for actual, expected in zip(grads, grads_eager):
        torch.testing.assert_close(actual, expected)
