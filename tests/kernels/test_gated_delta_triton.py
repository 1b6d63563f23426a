"""Gated delta Triton kernels: interpreter cases (in a subprocess), CPU fallbacks, and GPU checks.

The interpreter cases live in interpreter/gated_delta_triton_cases.py and run in a fresh interpreter
with TRITON_INTERPRET=1, because the variable must be set before triton is first imported and other
test modules of this process may already have imported it. The GPU tests (bf16 against float64
references, the decode step and its CUDA-graph replay) run here and skip without CUDA:
    python -m pytest -q -p no:cacheprovider tests/kernels/test_gated_delta_triton.py -m gpu
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from documents import doc_start_from_lengths
from helpers import (
    NAMES,
    assert_relative_close,
    cast,
    compare_to_float64,
    exact_step,
    random_inputs,
    random_step,
    run_interpreter_cases,
)


from atma_titan.kernels.documents import doc_start_from_flags
from atma_titan.kernels.gated_delta import (
    gated_delta,
    gated_delta_chunked,
    gated_delta_chunked_fla,
    gated_delta_chunked_triton,
    gated_delta_step_,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernels_under_the_triton_interpreter():
    run_interpreter_cases("gated_delta_triton_cases.py")


# ---------------------------------------------------------------------------------------------
# CPU without the interpreter


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="checks the GPU configs")
def test_gpu_dot_tiles_stay_clear_of_the_hopper_miscompile():
    """No tl.dot side below 64 in any GPU config: Triton >= 3.6 miscompiles sm_90 kernels with several
    dots of side 16 / 32 (illegal memory access on the H200 with BV = 32). Importing triton_chunked
    without TRITON_INTERPRET builds the GPU config lists; nothing is compiled or launched."""
    import triton

    from atma_titan.kernels.gated_delta import triton_chunked as chunked

    assert not chunked.INTERPRET and chunked.MIN_DOT_BLOCK >= 64 and chunked.CHUNK >= 64
    for name in ("SEQUENTIAL_CONFIGS", "PARALLEL_CONFIGS", "GRAD_CONFIGS"):
        configs = getattr(chunked, name)
        assert configs and all(c.kwargs["BV"] >= chunked.MIN_DOT_BLOCK for c in configs), name
    for dim in (1, 16, 24, 64, 80, 128, 200):
        assert chunked._block(dim) >= max(64, dim)
    assert chunked._dims(torch.empty(1, 1, 1, 24), torch.empty(1, 1, 1, 40))["bk"] == 64
    for kernel in (
        chunked._state_fwd_kernel,
        chunked._output_kernel,
        chunked._grad_transform_kernel,
        chunked._grad_output_kernel,
    ):
        assert kernel.configs and all(c.kwargs["BV"] >= 64 for c in kernel.configs)
    wide, narrow = triton.Config({"BV": 128}, num_warps=4), triton.Config({"BV": 64}, num_warps=4)
    assert chunked._prune_wide_blocks([wide, narrow], {}, DV=40) == [narrow]
    assert chunked._prune_wide_blocks([wide, narrow], {}, DV=80) == [wide, narrow]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter would run the kernel")
def test_chunked_kernel_on_cpu_names_the_reference():
    inputs = cast(random_inputs(1, 5, 1, 16, 16), torch.float32)
    with pytest.raises(RuntimeError, match="gated_delta_chunked"):
        gated_delta_chunked_triton(**inputs)


def test_chunked_kernel_checks_shapes_before_launching():
    inputs = cast(random_inputs(1, 5, 1, 16, 16), torch.float32)
    with pytest.raises(ValueError, match="beta"):
        gated_delta_chunked_triton(**{**inputs, "beta": inputs["beta"][:, :3]})
    with pytest.raises(ValueError, match="doc_start"):
        gated_delta_chunked_triton(**inputs, doc_start=torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="slots"):
        gated_delta_step_(torch.zeros(2, 1, 16, 16), torch.zeros(2, 1), *random_step(2, 1, 16, 16, seed=0).values())


def test_entry_point_passes_doc_start_on():
    inputs = random_inputs(2, 20, 2, 8, 8, seed=12)
    doc_start = doc_start_from_lengths([[5, 15], [1, 6, 13]])
    expected = gated_delta_chunked(**inputs, chunk_size=4, doc_start=doc_start)
    actual = gated_delta(**inputs, impl="reference", chunk_size=4, doc_start=doc_start)
    plain = gated_delta(**inputs, impl="reference", chunk_size=4)
    for a, e, p in zip(actual, expected, plain):
        assert torch.equal(a, e) and not torch.allclose(a, p)


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla is installed")
def test_fla_backend_explains_what_is_missing():
    inputs = cast(random_inputs(1, 5, 1, 16, 16), torch.float32)
    with pytest.raises(ImportError, match="fla-core"):
        gated_delta_chunked_fla(**inputs)


# ---------------------------------------------------------------------------------------------
# GPU: bf16 against float64 references, the decode step, CUDA graphs

GPU_CASES = [
    # (batch, seq_len, heads, key_dim, value_dim, with_initial_state)
    (2, 1000, 4, 128, 128, True),  # the model's head size, a ragged tail
    (2, 256, 2, 64, 128, False),
    (1, 130, 3, 128, 64, True),
    (3, 77, 2, 96, 80, True),  # dims that are not powers of two
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,seq_len,heads,key_dim,value_dim,with_initial_state", GPU_CASES)
def test_chunked_kernel_bf16_on_gpu(batch, seq_len, heads, key_dim, value_dim, with_initial_state):
    inputs = random_inputs(
        batch, seq_len, heads, key_dim, value_dim, with_initial_state=with_initial_state, seed=seq_len, device="cuda"
    )
    compare_to_float64(gated_delta_chunked_triton, inputs, torch.bfloat16, tol=3e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,seq_len,heads,key_dim,value_dim,with_initial_state", GPU_CASES[:3])
def test_chunked_kernel_with_documents_on_gpu(batch, seq_len, heads, key_dim, value_dim, with_initial_state):
    """Random document starts (about one per 40 tokens), plus a reset on a chunk start, one mid-chunk and a
    length-1 document, against the float64 reference with the same doc_start."""
    gen = torch.Generator().manual_seed(seq_len)
    starts = torch.rand(batch, seq_len, generator=gen) < 1 / 40
    starts[:, [64, 100, 101]] = True
    doc_start = doc_start_from_flags(starts).cuda()
    inputs = random_inputs(
        batch, seq_len, heads, key_dim, value_dim, with_initial_state=with_initial_state, seed=seq_len, device="cuda"
    )
    compare_to_float64(gated_delta_chunked_triton, inputs, torch.bfloat16, tol=3e-2, doc_start=doc_start)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_kernel_full_precision_on_gpu(dtype):
    inputs = random_inputs(2, 300, 2, 64, 64, seed=3, device="cuda")
    compare_to_float64(gated_delta_chunked_triton, inputs, dtype, tol=2e-4 if dtype == torch.float32 else 4e-3)


@pytest.mark.gpu
@needs_cuda
def test_step_kernel_on_gpu_in_place():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(70, 8, 128, 128, generator=gen).cuda()
    before = pool.clone()
    address = pool.data_ptr()
    slots = torch.randperm(70, generator=gen)[:64].cuda()
    token = {name: x.cuda() for name, x in random_step(64, 8, 128, 128, seed=1).items()}
    r = gated_delta_step_(pool, slots, **token)
    r_ref, new_ref = exact_step(before[slots], token)
    assert pool.data_ptr() == address
    assert_relative_close(r, r_ref, 1e-5, "r")
    assert_relative_close(pool[slots], new_ref, 1e-5, "updated slots")
    untouched = torch.ones(70, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.gpu
@needs_cuda
def test_step_kernel_replays_in_a_cuda_graph():
    pool = torch.randn(10, 4, 128, 128, device="cuda")
    slots = torch.tensor([7, 2, 5], device="cuda")
    static = {name: x.cuda() for name, x in random_step(3, 4, 128, 128, seed=2).items()}
    expected_state = pool[slots].double()
    gated_delta_step_(pool.clone(), slots, **static)  # compile outside the capture
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r_static = gated_delta_step_(pool, slots, **static)
    for seed in (3, 4):  # new tokens copied into the captured buffers, as a decode loop does
        token = random_step(3, 4, 128, 128, seed=seed)
        for name, x in token.items():
            static[name].copy_(x)
        graph.replay()
        r_ref, expected_state = exact_step(expected_state, static)
        assert_relative_close(r_static, r_ref, 1e-5, f"r after replay {seed}")
    assert_relative_close(pool[slots], expected_state, 1e-5, "state after two replays")


@pytest.mark.gpu
@needs_cuda
def test_prefill_then_decode_on_gpu():
    total, prefill = 200, 190
    inputs = cast(random_inputs(2, total, 2, 128, 128, seed=8, device="cuda"), torch.bfloat16)
    r_full, state_full = gated_delta_chunked_triton(**inputs)
    head = {name: x if name == "initial_state" else x[:, :prefill] for name, x in inputs.items()}
    _, state = gated_delta_chunked_triton(**head)
    pool = torch.zeros(3, 2, 128, 128, device="cuda")
    slots = torch.tensor([2, 0], device="cuda")
    pool[slots] = state
    decoded = [
        gated_delta_step_(pool, slots, **{name: inputs[name][:, t] for name in NAMES[:5]})
        for t in range(prefill, total)
    ]
    assert_relative_close(torch.stack(decoded, dim=1), r_full[:, prefill:], 2e-2, "decoded r")
    assert_relative_close(pool[slots], state_full, 2e-2, "state")


@pytest.mark.gpu
@needs_cuda
def test_chunked_op_compiles_with_fullgraph_on_gpu():
    inputs = cast(random_inputs(1, 100, 2, 64, 64, seed=6, device="cuda"), torch.bfloat16)
    for x in inputs.values():
        x.requires_grad_(True)

    def memory(q, k, v, log_gamma, beta, initial_state):
        r, state = gated_delta_chunked_triton(q, k, v, log_gamma, beta, initial_state=initial_state)
        return r.float().square().sum() + state.sum()

    loss = torch.compile(memory, fullgraph=True)(*inputs.values())
    grads = torch.autograd.grad(loss, list(inputs.values()))
    grads_eager = torch.autograd.grad(memory(*inputs.values()), list(inputs.values()))
    for actual, expected in zip(grads, grads_eager):
        torch.testing.assert_close(actual, expected)
