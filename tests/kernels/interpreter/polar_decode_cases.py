"""Paged Polar decode Triton kernel under the Triton interpreter (CPU), against float64 ground truth.

Run by test_polar_decode.py (alone: see this folder's conftest.py). The interpreter uses 32-row key tiles,
so pages of 16 are smaller than a tile and pages of 64 larger. The caches' pages are shuffled and fenced by
unused pages (tests/support/paged_decode_inputs.py); every check compares to the float64
`polar_attention_naive` last row over each sequence's own keys, never to the kernel itself.
"""

from __future__ import annotations

import pytest
import torch
from paged_decode_inputs import dense_last_rows, make_paged, rounded

from atma_titan.kernels.polar import polar_decode, polar_decode_reference, polar_decode_triton

# (context_lens, H, Hkv, D, page_size, max_blocks, window, num_splits to try)
CASES = {
    "page16_gqa4_ragged": ([1, 16, 45, 100], 4, 1, 16, 16, 8, 0, [None, 1, 3, 20]),
    "page64_mha": ([64, 130, 7], 2, 2, 32, 64, 3, 0, [None, 1, 2, 8]),
    "page16_window_below_context": ([100, 9, 50], 4, 1, 16, 16, 7, 20, [None, 1, 5]),
    "page64_window_above_context": ([150, 33], 4, 2, 16, 64, 3, 300, [None, 1, 3]),
    "page64_window_cuts_page": ([190, 70], 4, 1, 16, 64, 3, 100, [None, 3]),
}


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


def test_opcheck():
    inputs, _ = make_paged([20, 50], 4, 2, 16, 16, 4, seed=33, dtype=torch.float32)
    torch.library.opcheck(torch.ops.atma.polar_decode.default, (*inputs, 0, 2))


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
