"""Paged Polar decode: the PyTorch reference (in process), the Triton kernel (interpreter subprocess, GPU).

CPU: tests/kernels/interpreter/polar_decode_cases.py runs in a subprocess with TRITON_INTERPRET=1 (it must be
set before triton is imported, and another test module of this process may already have imported it).
GPU (skipped without CUDA): bf16 at 8 query / 2 KV heads, D 128, against the float64 reference, split and
unsplit (one- and two-level merges), pages of 16 and 256; CUDA-graph capture and replay after the block
table and lengths change.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import run_interpreter_cases
from paged_decode_inputs import dense_last_rows, make_paged, rounded

from atma_titan.kernels.paged import write_pages
from atma_titan.kernels.polar import polar_decode, polar_decode_reference, polar_decode_triton

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.slow
def test_interpreter_cases():
    run_interpreter_cases("polar_decode_cases.py")


# ---------------------------------------------------------------------------------------------
# Reference (CPU, in process)
# ---------------------------------------------------------------------------------------------

# (context_lens, H, Hkv, D, page_size, max_blocks, window)
REF_CASES = {
    "page16_gqa4_ragged": ([1, 16, 17, 100], 8, 2, 16, 16, 8, 0),
    "page64_mha": ([64, 130, 7], 2, 2, 32, 64, 3, 0),
    "window_below_context": ([100, 9, 50], 4, 1, 16, 16, 7, 20),
    "window_above_context": ([150, 33], 4, 2, 16, 64, 3, 300),
}


@pytest.mark.parametrize("case", REF_CASES.values(), ids=REF_CASES.keys())
def test_reference_matches_naive_last_row(case):
    context_lens, h, hkv, d, page_size, max_blocks, window = case
    inputs, dense = make_paged(context_lens, h, hkv, d, page_size, max_blocks, seed=41)
    c_ref, mag_ref = dense_last_rows(inputs, dense, window)
    c, mag = polar_decode_reference(*inputs, window=window)
    assert c.dtype == mag.dtype == torch.float64
    torch.testing.assert_close(c, c_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mag, mag_ref, rtol=1e-10, atol=1e-12)
    # auto on CPU is the reference; bf16 is reduced in fp32
    c, mag = polar_decode(*inputs, window=window)
    torch.testing.assert_close(c, c_ref, rtol=1e-10, atol=1e-12)
    low, dense_low = rounded(inputs, dense, torch.bfloat16)
    c16, mag16 = polar_decode(*low, window=window)
    c_low, mag_low = dense_last_rows(low, dense_low, window)
    assert c16.dtype == torch.bfloat16
    torch.testing.assert_close(c16.double(), c_low, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(mag16.double(), mag_low, rtol=1e-2, atol=1e-2)


def test_reference_matches_streaming_prefill_last_row():
    """Pages written with write_pages from a dense prefix give the dense forms' last query row."""
    from atma_titan.kernels.polar import polar_attention_reference

    b, t, h, hkv, d, page_size = 2, 37, 4, 2, 16, 16
    gen = torch.Generator().manual_seed(42)
    q, k, v = (torch.randn(b, t, n, d, generator=gen, dtype=torch.float64) for n in (h, hkv, hkv))
    params = [torch.randn(h, generator=gen, dtype=torch.float64) for _ in range(4)]
    params.append(torch.randn(h, d, generator=gen, dtype=torch.float64))
    max_blocks = 3
    block_table = torch.tensor([[5, 0, 2], [1, 4, 3]], dtype=torch.int32)
    k_pages = torch.zeros(6, page_size, hkv, d, dtype=torch.float64)
    v_pages = torch.zeros_like(k_pages)
    positions = torch.arange(t).expand(b, t)
    write_pages(k_pages, v_pages, block_table, positions, k, v)
    assert max_blocks * page_size >= t
    c_ref, mag_ref = polar_attention_reference(q, k, v, *params, window=10)
    c, mag = polar_decode_reference(
        q[:, -1], k_pages, v_pages, block_table, torch.full((b,), t, dtype=torch.int32), *params, window=10
    )
    torch.testing.assert_close(c, c_ref[:, -1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mag, mag_ref[:, -1], rtol=1e-10, atol=1e-12)


def test_reference_rejects_bad_inputs():
    inputs, _ = make_paged([5, 9], 4, 2, 16, 16, 2, seed=43)
    q, k_pages, v_pages, block_table, context_lens, *params = inputs
    with pytest.raises(ValueError, match="q must be"):
        polar_decode_reference(q[:, None], k_pages, v_pages, block_table, context_lens, *params)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        polar_decode_reference(q[:, :3], k_pages, v_pages, block_table, context_lens, *[p[:3] for p in params])
    with pytest.raises(ValueError, match="k_pages, v_pages"):
        polar_decode_reference(q, k_pages, v_pages[:, :8], block_table, context_lens, *params)
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        polar_decode_reference(q, k_pages[:, :12], v_pages[:, :12], block_table, context_lens, *params)
    with pytest.raises(ValueError, match="block_table"):
        polar_decode_reference(q, k_pages, v_pages, block_table[:1], context_lens, *params)
    with pytest.raises(ValueError, match="integer"):
        polar_decode_reference(q, k_pages, v_pages, block_table.float(), context_lens, *params)
    with pytest.raises(ValueError, match="context_lens must have shape"):
        polar_decode_reference(q, k_pages, v_pages, block_table, context_lens[:1], *params)
    with pytest.raises(ValueError, match="context_lens must lie"):
        polar_decode_reference(q, k_pages, v_pages, block_table, torch.tensor([0, 3], dtype=torch.int32), *params)
    with pytest.raises(ValueError, match="context_lens must lie"):
        polar_decode_reference(q, k_pages, v_pages, block_table, torch.tensor([33, 3], dtype=torch.int32), *params)
    with pytest.raises(ValueError, match="v_null"):
        polar_decode_reference(q, k_pages, v_pages, block_table, context_lens, *params[:4], params[4][:, :8])
    with pytest.raises(ValueError, match="window"):
        polar_decode_reference(q, k_pages, v_pages, block_table, context_lens, *params, window=-1)
    with pytest.raises(ValueError, match="unknown"):
        polar_decode(*inputs, impl="fast")


def test_cpu_kernel_without_interpreter_raises():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter")
    inputs, _ = make_paged([5], 2, 1, 16, 16, 1, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        polar_decode_triton(*inputs)


def test_split_policy_is_shape_only_and_covers_the_table():
    pytest.importorskip("triton")
    from atma_titan.kernels.polar.triton_decode import decode_split

    for batch, hkv, max_blocks, page_size in [(1, 2, 4096, 16), (1, 2, 256, 256), (32, 2, 2048, 16), (64, 2, 16, 256)]:
        for block_n in (32, 64):
            splits, pps = decode_split(batch, hkv, max_blocks, page_size, 132, block_n=block_n)
            assert (splits - 1) * pps < max_blocks <= splits * pps
            assert (pps * page_size) % block_n == 0 or page_size >= block_n
    # small batch x long context: many splits; large batch: few
    assert decode_split(1, 2, 4096, 16, 132)[0] >= 128
    assert decode_split(64, 2, 256, 16, 132)[0] <= 16
    # never more than one wave of 4 programs per SM; one split once the batch alone fills it
    for batch, max_blocks in [(1, 4096), (8, 4096), (32, 2048), (64, 256)]:
        splits, _ = decode_split(batch, 2, max_blocks, 16, 132)
        assert batch * 2 * splits <= 4 * 132
    assert decode_split(512, 2, 256, 16, 132)[0] == 1
    # an override larger than the table is limited to one split per (tile of) pages
    assert decode_split(1, 1, 4, 16, 132, block_n=32, num_splits=100) == (2, 2)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

# (context_lens, page_size, max_blocks, window)
GPU_CASES = {
    "page16_ragged": ([1, 16, 255, 1000, 3001], 16, 200, 0),
    "page256_ragged": ([1, 256, 257, 3001, 9000], 256, 40, 0),
    "page16_window": ([70, 1000, 3001], 16, 200, 500),
    "page256_window": ([300, 5000, 9000], 256, 40, 1000),
}


def _gpu_inputs(context_lens, page_size, max_blocks, seed):
    inputs, dense = make_paged(context_lens, 8, 2, 128, page_size, max_blocks, seed=seed, dtype=torch.float32)
    low, _ = rounded(inputs, dense, torch.bfloat16)
    # the per-head parameters stay fp32, as the model keeps them
    low[5:] = inputs[5:]
    low = [x.cuda() for x in low]
    exact = [x.double() if x.is_floating_point() else x for x in low]
    return low, exact


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_bf16_matches_float64(case):
    context_lens, page_size, max_blocks, window = case
    low, exact = _gpu_inputs(context_lens, page_size, max_blocks, seed=51)
    c_ref, mag_ref = polar_decode_reference(*exact, window=window)
    for num_splits in (None, 1, 7, 40):  # 40: more splits than a merge bucket (two-level merge)
        c, mag = polar_decode(*low, window=window, impl="triton", num_splits=num_splits)
        assert c.dtype == mag.dtype == torch.bfloat16
        torch.testing.assert_close(c.double(), c_ref, rtol=2e-2, atol=2e-2, msg=f"c, num_splits={num_splits}")
        torch.testing.assert_close(mag.double(), mag_ref, rtol=2e-2, atol=2e-2, msg=f"mag, num_splits={num_splits}")
    # auto is the kernel on CUDA
    c_auto, _ = polar_decode(*low, window=window)
    torch.testing.assert_close(c_auto, polar_decode_triton(*low, window=window)[0], rtol=0, atol=0)


@needs_cuda
@pytest.mark.gpu
def test_float32_on_gpu_is_exact_products():
    inputs, _ = make_paged([1, 100, 2000], 8, 2, 128, 16, 130, seed=52, dtype=torch.float32)
    inputs = [x.cuda() for x in inputs]
    c_ref, mag_ref = polar_decode_reference(*(x.double() if x.is_floating_point() else x for x in inputs))
    c, mag = polar_decode_triton(*inputs, num_splits=5)
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(mag.double(), mag_ref, rtol=1e-4, atol=2e-5)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 256])
def test_cuda_graph_replay_follows_changed_tables(page_size):
    max_blocks = 4096 // page_size
    low, _ = _gpu_inputs([4096, 4096, 4096], page_size, max_blocks, seed=53)
    q, k_pages, v_pages, block_table, context_lens, *params = low
    static_lens, static_table = context_lens.clone(), block_table.clone()

    def step():
        return polar_decode(q, k_pages, v_pages, static_table, static_lens, *params, window=0, impl="triton")

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c_static, mag_static = step()

    gen = torch.Generator().manual_seed(54)
    for lens in ([1, 2000, 4096], [4096, 17, 300]):
        new_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        # a different page order: reverse each row (the pages hold other keys now)
        new_table = block_table[:, torch.randperm(max_blocks, generator=gen).cuda()]
        static_lens.copy_(new_lens)
        static_table.copy_(new_table)
        graph.replay()
        c_eager, mag_eager = polar_decode(q, k_pages, v_pages, new_table, new_lens, *params, impl="triton")
        torch.testing.assert_close(c_static, c_eager, rtol=0, atol=0)
        torch.testing.assert_close(mag_static, mag_eager, rtol=0, atol=0)
        exact = [x.double() if x.is_floating_point() else x for x in (q, k_pages, v_pages)]
        c_ref, _ = polar_decode_reference(*exact, new_table, new_lens, *(p.double() for p in params))
        torch.testing.assert_close(c_static.double(), c_ref, rtol=2e-2, atol=2e-2)


@needs_cuda
@pytest.mark.gpu
def test_compiled_decode_has_no_graph_break():
    low, _ = _gpu_inputs([100, 3000], 16, 200, seed=55)
    eager = polar_decode(*low, impl="triton")
    compiled = torch.compile(lambda *a: polar_decode(*a, impl="triton"), fullgraph=True)(*low)
    for a, e in zip(compiled, eager):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
