"""torch.library registration of the fused Polar attention kernel, and the public entry point.

`polar_attention(..., impl=)` picks the implementation (auto | triton | reference, see
kernels/backends.py; `auto` also keeps the reference for head sizes the kernel does not take);
`polar_attention_triton` is the kernel alone. It runs through two custom ops, so
`torch.compile(fullgraph=True)` sees one opaque node each way (on CUDA, and on CPU under
TRITON_INTERPRET=1):

- `atma::polar_attention_fwd(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window,
  doc_start=None)` -> (c, mag, lse, n_eff, s_norm): outputs in q's dtype plus fp32 (B, H, Tq) statistics.
- `atma::polar_attention_bwd(g_c, g_mag, q, k, v, len_gain, null_base, null_slope, mag_beta, v_null,
  c, lse, n_eff, s_norm, window, doc_start=None)` -> the eight input gradients.

`doc_start` (None, or integer (B, Tk) indexed by key position: kernels/documents.py) keeps packed documents
apart: each query sees its own document's keys and takes its own document's count n (reference.py). It has
no gradient; the kernels compile a separate variant for it, so None runs the code of before.

Why custom_op and not triton_op: on CPU Inductor tries to build a triton_op's kernels (no driver); on the
H200 (torch 2.11, Triton 3.6) Inductor failed to compile these kernels from a triton_op (a CompilationError
at the first helper call), while the compiled custom op matches the eager kernels forward+backward within
3% from 2K to 64K (`benchmarks/kernels/polar_attention.py --backends compiled,polar_triton`): for kernels of
milliseconds an opaque op costs nothing measurable.

Triton (triton_attention.py) is imported on the first kernel call only, so importing this module
works on machines without it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from atma_titan.kernels import backends
from atma_titan.kernels.polar.reference import _check_inputs, polar_attention_reference

__all__ = ["polar_attention", "polar_attention_triton", "supports_head_dim"]


def supports_head_dim(d: int) -> bool:
    """tl.arange needs a power of two and tl.dot an inner dimension of at least 16."""
    return 16 <= d <= 256 and d & (d - 1) == 0


def _check_head_dim(d: int) -> None:
    if not supports_head_dim(d):
        raise ValueError(f"the Triton Polar kernel needs a power-of-two head_dim in [16, 256], got {d}")


def _kernels(device: torch.device):
    """The Triton module, after checking it can run on `device`."""
    return backends.kernel_module(
        "atma_titan.kernels.polar.triton_attention", device, "the Triton Polar attention kernel",
        "polar_bwd_preamble_kernel",
        "atma_titan.kernels.polar.polar_attention_reference (the PyTorch reference)",
    )  # fmt: skip


@torch.library.custom_op("atma::polar_attention_fwd", mutates_args=())
def polar_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    len_gain: Tensor,
    null_base: Tensor,
    null_slope: Tensor,
    mag_beta: Tensor,
    v_null: Tensor,
    window: int,
    doc_start: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _kernels(q.device).polar_forward(
        q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window, doc_start
    )


@polar_attention_fwd.register_fake
def _(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window, doc_start=None):
    b, tq, h, _ = q.shape
    stats = [q.new_empty(b, h, tq, dtype=torch.float32) for _ in range(3)]
    return (q.new_empty(q.shape), q.new_empty(b, tq, h), *stats)


@torch.library.custom_op("atma::polar_attention_bwd", mutates_args=())
def polar_attention_bwd(
    g_c: Tensor,
    g_mag: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    len_gain: Tensor,
    null_base: Tensor,
    null_slope: Tensor,
    mag_beta: Tensor,
    v_null: Tensor,
    c: Tensor,
    lse: Tensor,
    n_eff: Tensor,
    s_norm: Tensor,
    window: int,
    doc_start: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    kernels = _kernels(q.device)
    grads = kernels.polar_backward(
        g_c.contiguous(), g_mag, q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, c, lse, n_eff, s_norm,
        window, doc_start,
    )  # fmt: skip
    params = (len_gain, null_base, null_slope, mag_beta, v_null)
    return (*grads[:3], *(g.to(p.dtype) for g, p in zip(grads[3:], params)))


@polar_attention_bwd.register_fake
def _(g_c, g_mag, q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, c, lse, n_eff, s_norm, window,
      doc_start=None):  # fmt: skip
    return tuple(x.new_empty(x.shape) for x in (q, k, v, len_gain, null_base, null_slope, mag_beta, v_null))


def _setup_context(ctx, inputs, output):
    q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window, doc_start = inputs
    c, _, lse, n_eff, s_norm = output
    ctx.mark_non_differentiable(lse, n_eff, s_norm)
    ctx.save_for_backward(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, c, lse, n_eff, s_norm, doc_start)
    ctx.window = window


def _backward(ctx, g_c, g_mag, *_stat_grads):
    *saved, doc_start = ctx.saved_tensors
    c = saved[8]
    g_c = torch.zeros_like(c) if g_c is None else g_c
    g_mag = c.new_zeros(c.shape[:3]) if g_mag is None else g_mag
    grads = torch.ops.atma.polar_attention_bwd(g_c, g_mag, *saved, ctx.window, doc_start)
    return (*grads, None, None)


polar_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def polar_attention_triton(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, *, window=0, doc_start=None):
    """Fused Polar attention (same contract as `polar_attention_reference`): returns c (B, Tq, H, D),
    mag (B, Tq, H).

    q (B, Tq, H, D); k, v (B, Tk, Hkv, D) with Tq <= Tk (queries are the last Tq positions);
    len_gain, null_base, null_slope, mag_beta (H,); v_null (H, D); doc_start None or int32 (B, Tk)
    (kernels/documents.py). head_dim must be a power of two in [16, 256]. CUDA, or CPU under
    TRITON_INTERPRET=1.
    """
    _check_inputs(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window, doc_start)
    _check_head_dim(q.shape[-1])
    c, mag, *_ = torch.ops.atma.polar_attention_fwd(
        q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, window, doc_start
    )
    return c, mag


def polar_attention(
    q,
    k,
    v,
    len_gain,
    null_base,
    null_slope,
    mag_beta,
    v_null,
    *,
    window: int = 0,
    doc_start: Tensor | None = None,
    impl: str = "auto",
    block_q: int = 128,
    block_k: int = 128,
    what: str = "impl",
):
    """Polar attention by `impl`: c (B, Tq, H, D), mag (B, Tq, H) in q's dtype.

    impl: `auto` (the Triton kernel on CUDA when triton is installed and the head size fits it, else
    the reference), `triton` (the kernel, or an error saying why it cannot run) or `reference`
    (`polar_attention_reference`, in query / key tiles of block_q / block_k; the kernel picks its own).
    `what` names the setting in error messages (the model passes its config key). Shapes as in
    `polar_attention_reference`; doc_start (None, or int32 (B, Tk)) keeps packed documents apart.
    """
    scalars = (len_gain, null_base, null_slope, mag_beta, v_null)
    # `auto` keeps the reference for head sizes the kernel does not take; `triton` says why it can't
    kernel_fits = impl == "triton" or supports_head_dim(q.shape[-1])
    if kernel_fits and backends.use_triton(impl, q.device, what):
        return polar_attention_triton(q, k, v, *scalars, window=window, doc_start=doc_start)
    return polar_attention_reference(
        q, k, v, *scalars, window=window, block_q=block_q, block_k=block_k, doc_start=doc_start
    )
