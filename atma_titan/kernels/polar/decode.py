"""torch.library registration of the paged Polar decode kernel, and the public decode entry point.

`polar_decode(..., impl=)` picks the implementation like `polar_attention` (auto | triton | reference,
kernels/backends.py; `auto` keeps the reference for head sizes or dtypes the kernel does not take);
`polar_decode_triton` is the kernel alone. It runs through one forward-only custom op, so
`torch.compile(fullgraph=True)` and CUDA-graph capture see one opaque node:

- `atma::polar_decode(q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope,
  mag_beta, v_null, window, num_splits)` -> (c, mag) in q's dtype; num_splits 0 takes the split policy
  (triton_decode.decode_split).

Triton (triton_decode.py) is imported on the first kernel call only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atma_titan.kernels import backends
from atma_titan.kernels.polar.ops import supports_head_dim
from atma_titan.kernels.polar.reference import _check_decode_inputs, polar_decode_reference

__all__ = ["polar_decode", "polar_decode_triton", "supports_decode_dtype"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports_decode_dtype(dtype: torch.dtype) -> bool:
    return dtype in _KERNEL_DTYPES


def _kernels(device: torch.device):
    """The Triton decode module, after checking it can run on `device`."""
    return backends.kernel_module(
        "atma_titan.kernels.polar.triton_decode", device, "the Triton Polar decode kernel",
        "polar_decode_kernel", "atma_titan.kernels.polar.polar_decode_reference",
    )  # fmt: skip


@torch.library.custom_op("atma::polar_decode", mutates_args=())
def polar_decode_op(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    block_table: Tensor,
    context_lens: Tensor,
    len_gain: Tensor,
    null_base: Tensor,
    null_slope: Tensor,
    mag_beta: Tensor,
    v_null: Tensor,
    window: int,
    num_splits: int,
) -> tuple[Tensor, Tensor]:
    return _kernels(q.device).polar_decode_forward(
        q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope, mag_beta, v_null,
        window, num_splits or None,
    )  # fmt: skip


@polar_decode_op.register_fake
def _(q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope, mag_beta, v_null, window, ns):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2])


def polar_decode_triton(
    q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope, mag_beta, v_null, *,
    window: int = 0, num_splits: int | None = None,
):  # fmt: skip
    """The paged split-KV decode kernel (same contract as `polar_decode_reference`): c (B, H, D), mag (B, H).

    head_dim a power of two in [16, 256]; q in fp16, bf16 or fp32 (the pages are cast to q's dtype if
    they differ). `num_splits` forces the split count (tests); None takes the shape-only split policy.
    CUDA, or CPU under TRITON_INTERPRET=1. No host sync: CUDA-graph capturable.
    """
    _check_decode_inputs(
        q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope, mag_beta, v_null, window
    )
    if not supports_head_dim(q.shape[-1]):
        raise ValueError(f"the Triton Polar decode kernel needs a power-of-two head_dim in [16, 256]: {q.shape[-1]}")
    if not supports_decode_dtype(q.dtype):
        raise ValueError(f"the Triton Polar decode kernel takes fp16, bf16 or fp32 inputs, got {q.dtype}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if k_pages.dtype != q.dtype:
        k_pages, v_pages = k_pages.to(q.dtype), v_pages.to(q.dtype)
    return torch.ops.atma.polar_decode(
        q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope, mag_beta, v_null,
        window, num_splits or 0,
    )  # fmt: skip


def polar_decode(
    q,
    k_pages,
    v_pages,
    block_table,
    context_lens,
    len_gain,
    null_base,
    null_slope,
    mag_beta,
    v_null,
    *,
    window: int = 0,
    impl: str = "auto",
    num_splits: int | None = None,
    what: str = "impl",
):
    """Polar decode by `impl`: c (B, H, D), mag (B, H) in q's dtype, for one query per sequence over a
    paged KV cache (layouts and semantics in `polar_decode_reference`).

    impl: `auto` (the Triton kernel on CUDA when triton is installed and the head size and dtype fit
    it, else the reference), `triton` (the kernel, or an error saying why it cannot run) or `reference`.
    `num_splits` forces the kernel's split count (tests); `what` names the setting in error messages
    (the model passes its config key).
    """
    args = (q, k_pages, v_pages, block_table, context_lens, len_gain, null_base, null_slope, mag_beta, v_null)
    kernel_fits = impl == "triton" or (supports_head_dim(q.shape[-1]) and supports_decode_dtype(q.dtype))
    if backends.use_triton(impl, q.device, what) and kernel_fits:  # use_triton also rejects unknown impls
        return polar_decode_triton(*args, window=window, num_splits=num_splits)
    if k_pages.dtype != q.dtype:
        k_pages, v_pages = k_pages.to(q.dtype), v_pages.to(q.dtype)
        args = (q, k_pages, v_pages, *args[3:])
    return polar_decode_reference(*args, window=window)
