"""Paged Polar decode Triton kernel under the Triton interpreter (CPU), against float64 ground truth.

Not collected by the suite on its own (the name does not start with test_): test_polar_decode.py runs
this file in a subprocess with TRITON_INTERPRET=1 (set before triton is imported), and imports its
helpers (`make_paged`, `dense_last_rows`). Alone:
    TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider tests/kernels/polar_decode_cases.py
The interpreter uses 32-row key tiles, so pages of 16 are smaller than a tile and pages of 64 larger.
Block tables are shuffled (pages in random order, unused pages filled with large values in between,
entries past a sequence's last page pointing at such a page); every check compares to the float64
`polar_attention_naive` last row over each sequence's own keys, never to the kernel itself.
"""

from __future__ import annotations

import os

import pytest
import torch

from atma_titan.kernels.polar import polar_decode, polar_decode_reference, polar_decode_triton
from atma_titan.kernels.polar.reference import polar_attention_naive

# on the functions of this file only: test_polar_decode.py imports the helpers without the marker
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 set before triton is imported"
)

GARBAGE = 300.0  # value of unused pages: any read of one shows in the result


def make_paged(context_lens, h, hkv, d, page_size, max_blocks, *, seed=0, spare_pages=5, dtype=torch.float64):
    """Random decode inputs over a shuffled paged cache.

    Returns (q, k_pages, v_pages, block_table, context_lens, *params) in the argument order of
    `polar_decode`, and the dense per-sequence keys and values (B, max_blocks * page_size, Hkv, D).
    """
    gen = torch.Generator().manual_seed(seed)
    b = len(context_lens)

    def rand(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift

    cap = max_blocks * page_size
    k_dense, v_dense = rand(b, cap, hkv, d), rand(b, cap, hkv, d)
    num_pages = b * max_blocks + spare_pages
    perm = torch.randperm(num_pages, generator=gen)
    used, spare = perm[: b * max_blocks].reshape(b, max_blocks), perm[b * max_blocks :]
    k_pages = torch.full((num_pages, page_size, hkv, d), GARBAGE, dtype=torch.float64)
    v_pages = torch.full_like(k_pages, GARBAGE)
    block_table = used.clone()
    for i, n in enumerate(context_lens):
        n_blocks = -(-n // page_size)
        for j in range(n_blocks):
            k_pages[used[i, j]] = k_dense[i, j * page_size : (j + 1) * page_size]
            v_pages[used[i, j]] = v_dense[i, j * page_size : (j + 1) * page_size]
        block_table[i, n_blocks:] = spare[0] if len(spare) else 0  # never read
    params = [
        rand(h, shift=-0.5),  # len_gain
        rand(h, shift=1.0),  # null_base
        rand(h),  # null_slope
        rand(h, shift=-1.0),  # mag_beta
        rand(h, d, scale=0.5),  # v_null
    ]
    q = rand(b, h, d)
    inputs = [q, k_pages, v_pages, block_table.to(torch.int32), torch.tensor(context_lens, dtype=torch.int32)]
    inputs = [x.to(dtype) if x.is_floating_point() else x for x in inputs] + [p.to(dtype) for p in params]
    return inputs, (k_dense.to(dtype), v_dense.to(dtype))


def dense_last_rows(inputs, dense, window=0):
    """Ground truth: per sequence, the last row of the float64 `polar_attention_naive` over its own keys."""
    q, _, _, _, context_lens, *params = (x.double() if x.is_floating_point() else x for x in inputs)
    k_dense, v_dense = (x.double() for x in dense)
    cs, mags = [], []
    for i, n in enumerate(context_lens.tolist()):
        k, v = k_dense[i, None, :n], v_dense[i, None, :n]
        c, mag = polar_attention_naive(q[i, None, None], k, v, *params, window=window)
        cs.append(c[0, 0])
        mags.append(mag[0, 0])
    return torch.stack(cs), torch.stack(mags)


def rounded(inputs, dense, dtype):
    """The inputs in `dtype` (kernel side) and the dense keys rounded the same way (ground-truth side)."""
    low = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
    return low, tuple(x.to(dtype) for x in dense)


# (context_lens, H, Hkv, D, page_size, max_blocks, window, num_splits to try)
CASES = {
    "page16_gqa4_ragged": ([1, 16, 45, 100], 4, 1, 16, 16, 8, 0, [None, 1, 3, 20]),
    "page64_mha": ([64, 130, 7], 2, 2, 32, 64, 3, 0, [None, 1, 2, 8]),
    "page16_window_below_context": ([100, 9, 50], 4, 1, 16, 16, 7, 20, [None, 1, 5]),
    "page64_window_above_context": ([150, 33], 4, 2, 16, 64, 3, 300, [None, 1, 3]),
    "page64_window_cuts_page": ([190, 70], 4, 1, 16, 64, 3, 100, [None, 3]),
}


@interpreted
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_float32_kernel_and_reference_match_float64(case):
    context_lens, h, hkv, d, page_size, max_blocks, window, splits = case
    inputs, dense = make_paged(context_lens, h, hkv, d, page_size, max_blocks, seed=31)
    inputs32, dense32 = rounded(inputs, dense, torch.float32)
    c_ref, mag_ref = dense_last_rows(inputs32, dense32, window)
    for num_splits in splits:
        c, mag = polar_decode_triton(*inputs32, window=window, num_splits=num_splits)
        assert c.shape == (len(context_lens), h, d) and mag.shape == (len(context_lens), h)
        assert c.dtype == mag.dtype == torch.float32
        torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=2e-5, msg=f"c, num_splits={num_splits}")
        torch.testing.assert_close(mag.double(), mag_ref, rtol=1e-4, atol=2e-5, msg=f"mag, num_splits={num_splits}")
    c, mag = polar_decode_reference(*inputs32, window=window)
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mag.double(), mag_ref, rtol=1e-5, atol=1e-6)


@interpreted
@pytest.mark.parametrize("case", ["page16_gqa4_ragged", "page64_window_cuts_page"])
def test_float16_close_to_float64(case):
    context_lens, h, hkv, d, page_size, max_blocks, window, splits = CASES[case]
    inputs, dense = make_paged(context_lens, h, hkv, d, page_size, max_blocks, seed=32)
    inputs16, dense16 = rounded(inputs, dense, torch.float16)
    c_ref, mag_ref = dense_last_rows(inputs16, dense16, window)
    for num_splits in (None, 1):
        c, mag = polar_decode(*inputs16, window=window, impl="triton", num_splits=num_splits)
        assert c.dtype == mag.dtype == torch.float16
        torch.testing.assert_close(c.double(), c_ref, rtol=3e-3, atol=3e-3)
        torch.testing.assert_close(mag.double(), mag_ref, rtol=3e-3, atol=3e-3)


@interpreted
def test_opcheck():
    inputs, _ = make_paged([20, 50], 4, 2, 16, 16, 4, seed=33, dtype=torch.float32)
    torch.library.opcheck(torch.ops.atma.polar_decode.default, (*inputs, 0, 2))


@interpreted
@pytest.mark.parametrize("bucket", [1, 2])
def test_two_level_merge(bucket, monkeypatch):
    """Buckets smaller than the split count: the bucket folds, then the fold of the buckets (several steps
    of MERGE_BLOCK_S with bucket 2 and 8 splits, a short last bucket with 5); counters left at 0."""
    from atma_titan.kernels.polar import triton_decode

    monkeypatch.setattr(triton_decode, "MERGE_BUCKET", bucket)
    context_lens, h, hkv, d, page_size, max_blocks, window, _ = CASES["page16_gqa4_ragged"]
    inputs, dense = make_paged(context_lens, h, hkv, d, page_size, max_blocks * 4, seed=34)
    inputs32, dense32 = rounded(inputs, dense, torch.float32)
    c_ref, mag_ref = dense_last_rows(inputs32, dense32, window)
    for num_splits in (None, 5, 8):
        c, mag = polar_decode_triton(*inputs32, window=window, num_splits=num_splits)
        torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=2e-5, msg=f"c, num_splits={num_splits}")
        torch.testing.assert_close(mag.double(), mag_ref, rtol=1e-4, atol=2e-5, msg=f"mag, num_splits={num_splits}")
    assert all(int(buf.abs().sum()) == 0 for buf in triton_decode._COUNTERS[torch.device("cpu")])
