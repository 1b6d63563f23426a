"""Inputs and ground truth for the paged Polar decode kernel (tests/kernels/test_polar_decode.py,
tests/kernels/test_kernel_resources.py, tests/kernels/interpreter/polar_decode_cases.py).

`make_paged` builds a decode batch over a shuffled paged cache: pages in random order, unused pages
filled with a large value in between and block-table entries past a sequence's last page pointing at
one, so that any read of a page a sequence does not own shows in the result. `dense_last_rows` is the
ground truth: the float64 `polar_attention_naive` last row over each sequence's own keys.
"""

import torch

from atma_titan.kernels.polar.reference import polar_attention_naive

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
