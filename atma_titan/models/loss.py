"""The LM head's loss without the (tokens x vocab) logits: a fused linear + soft-capped cross-entropy.

    loss = sum_i w_i * CE(softcap(x_i W^T + b), y_i)        over labels y_i != ignore_index

The tokens are taken a chunk at a time. Each chunk computes its logits with the head's matmul (in the
input dtype), adds its part of the loss and at once its gradients with respect to the hidden states, the
weight and the bias. Nothing of size tokens x vocab outlives a chunk, neither logits nor their gradient;
the autograd backward only scales the stored gradients by the incoming gradient. Gradients are computed
only when some input requires one.

The cap, log-sum-exp and softmax run in fp32, two ways (`impl`):
- the Triton kernel (kernels/softcap_ce; auto on CUDA): two passes over the chunk's bf16 logits, the
  second writing their gradient over them in place;
- plain PyTorch (`_chunk`, elsewhere and for fp64): an fp32 copy of the logits and element-wise passes
  over it, which torch.compile can fuse (`compile_backend`).

The chunk loop is one custom op, opaque to torch.compile, so a compiled head (fullgraph) calls it as one
node at any shapes. It knows nothing about parallelism: under FSDP2 it runs inside the head's forward,
on the gathered parameters.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from atma_titan.kernels.backends import gradients_flow
from atma_titan.kernels.softcap_ce import kernel_runs, softcap, softcap_ce_backward_, softcap_ce_forward

__all__ = ["LossTargets", "chunk_tokens_for", "linear_softcap_cross_entropy", "softcap", "add_product_"]

IGNORE_INDEX = -100  # as F.cross_entropy: such labels add nothing to the loss or the gradients
DEFAULT_CHUNK_MIB = 1024.0  # ~5,300 tokens at vocab 50,304: larger chunks were faster on the H200


class LossTargets:
    """What the head needs to return the loss instead of the logits: labels, optional per-label weights
    (data.recall_weight), the chunk budget, and the torch.compile backend of the chunk math (None: eager).

    A plain object on purpose, not tensors nor a dataclass: FSDP2's mixed-precision policy casts every
    floating-point tensor among a module's inputs (inside dicts, tuples and dataclasses too) to the
    parameters' dtype, and fp32 loss weights would reach the head rounded to bf16.
    """

    __slots__ = ("labels", "weights", "chunk_mib", "compile_backend")

    def __init__(
        self,
        labels: torch.Tensor,
        weights: torch.Tensor | None = None,
        chunk_mib: float = DEFAULT_CHUNK_MIB,
        compile_backend: str | None = None,
    ):
        self.labels, self.weights = labels, weights
        self.chunk_mib, self.compile_backend = chunk_mib, compile_backend


def chunk_tokens_for(vocab_size: int, chunk_mib: float) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take at most `chunk_mib` MiB (at least one token)."""
    if not chunk_mib > 0:
        raise ValueError(f"chunk_mib must be > 0, got {chunk_mib!r}")
    return max(1, int(chunk_mib * 2**20) // (4 * vocab_size))


def linear_softcap_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    cap: float = 0.0,
    chunk_tokens: int | None = None,
    chunk_mib: float = DEFAULT_CHUNK_MIB,
    ignore_index: int = IGNORE_INDEX,
    compile_backend: str | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """The summed (weighted) CE of softcap(hidden @ weight.T + bias) against `labels`, as an fp32 scalar.

    hidden (..., d); weight (V, d); bias (V,) or None; labels and weights (...). The same value as
    `F.cross_entropy(softcap(F.linear(hidden, weight, bias).float(), cap), labels, reduction="none")`
    times `weights`, summed. Chunks hold `chunk_tokens` tokens (default: fp32 logits of `chunk_mib` MiB).
    Under autocast the matmuls run in the autocast dtype, as nn.Linear's would. `impl` (auto | triton |
    reference) picks the cross-entropy's implementation; `compile_backend` compiles the reference's chunk
    math (the matmuls and the fused element-wise rest) with torch.compile.
    """
    d = hidden.shape[-1]
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape)}")
    if weights is not None and weights.shape != labels.shape:
        raise ValueError(f"loss weights {tuple(weights.shape)} do not match labels {tuple(labels.shape)}")
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0], chunk_mib)
    flat = (hidden.reshape(-1, d), weight, bias, labels.reshape(-1), None if weights is None else weights.reshape(-1))
    options = (float(cap), int(chunk), int(ignore_index), compile_backend or "", impl)
    if gradients_flow(hidden, weight, bias):
        return _FusedLinearCE.apply(*flat, *options)
    return _fused_loss_and_grads(*flat, *options, with_grads=False)[0]


class _FusedLinearCE(torch.autograd.Function):
    """Forward computes the loss and all gradients; backward scales them by grad_output."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, weights, cap, chunk, ignore_index, backend, impl):
        loss, grad_hidden, grad_weight, grad_bias = _fused_loss_and_grads(
            hidden, weight, bias, labels, weights, cap, chunk, ignore_index, backend, impl, with_grads=True
        )
        ctx.has_bias = bias is not None
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        grad_bias = grad_bias * grad_loss if ctx.has_bias else None
        return grad_hidden * grad_loss, grad_weight * grad_loss, grad_bias, *[None] * 7


# An opaque op to torch.compile: the compiled head (fullgraph) calls it as one node whatever the shapes
# (a traced chunk loop would unroll over the token count, which fails once that count is dynamic), and
# the loop runs chunk after chunk, so a chunk's buffers are freed before the next one's are made.
@torch.library.custom_op("atma_titan::fused_linear_softcap_ce", mutates_args=())
def _fused_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    cap: float,
    chunk: int,
    ignore_index: int,
    backend: str,
    impl: str,
    with_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight, grad_bias); without with_grads (or bias) the gradients are empty.

    The weight and bias gradients add up in fp32 (fp64 for fp64 inputs) and are returned in the
    parameters' dtype; the hidden-state gradient in the hidden states' dtype.
    """
    acc = torch.promote_types(hidden.dtype, torch.float32)
    if kernel_runs(hidden.dtype, hidden.device, impl, "model.loss_impl"):
        step = functools.partial(_kernel_chunk, impl=impl)
    else:
        step = _chunk_function(backend)
    n = hidden.shape[0]
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if with_grads else hidden.new_empty(0)
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if with_grads else weight.new_empty(0)
    grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if with_grads and bias is not None else None
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        part = step(
            hidden[start:end],
            weight,
            bias,
            labels[start:end],
            None if weights is None else weights[start:end],
            cap,
            ignore_index,
            acc,
            with_grads,
        )
        loss += part[0]
        if with_grads:
            grad_hidden[start:end] = part[1]
            add_product_(grad_weight, part[2].t(), hidden[start:end])
            if bias is not None:
                grad_bias += part[3]
    if not with_grads:
        return loss, grad_hidden, grad_weight, hidden.new_empty(0)
    grad_bias = hidden.new_empty(0) if bias is None else grad_bias.to(bias.dtype)
    return loss, grad_hidden, grad_weight.to(weight.dtype), grad_bias


@_fused_loss_and_grads.register_fake
def _(hidden, weight, bias, labels, weights, cap, chunk, ignore_index, backend, impl, with_grads):
    loss = hidden.new_empty((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    if not with_grads:
        return loss, hidden.new_empty(0), weight.new_empty(0), hidden.new_empty(0)
    grad_bias = hidden.new_empty(0) if bias is None else torch.empty_like(bias)
    return loss, torch.empty_like(hidden), torch.empty_like(weight), grad_bias


@functools.lru_cache(maxsize=None)
def _chunk_function(backend: str):
    """The chunk's math, compiled with `backend`, with a dynamic chunk length: the full chunks and the
    last, shorter one share a graph, and a new token count or chunk budget does not recompile."""
    return torch.compile(_chunk, backend=backend, fullgraph=True, dynamic=True) if backend else _chunk


def _chunk(x, weight, bias, labels, weights, cap: float, ignore_index: int, acc: torch.dtype, with_grads: bool):
    """One chunk's loss and, with_grads, its gradients w.r.t. x and bias, and the gradient of the logits in x's
    dtype (the weight's gradient is their product with x: the caller adds it up over the chunks).

    In-place updates of the chunk's own fp32 buffers keep an eager run at about two chunk-sized
    buffers at a time (nothing here is recorded by autograd). Compiled, the same code was as fast as an
    out-of-place form written for fusion (one-hot by comparison, no scatter) at the default chunk size
    on the H200, and that form held about 3x the memory eager.
    """
    z = F.linear(x, weight, bias).to(acc)
    if cap:
        inv = z.square().add_(cap * cap).rsqrt_()  # 1 / sqrt(z^2 + c^2)
        s = z.mul_(inv).mul_(cap)  # the capped logits, in z's buffer
    else:
        s = z
    lse = torch.logsumexp(s, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0).unsqueeze(1)
    scale = valid.to(acc) if weights is None else torch.where(valid, weights.to(acc), 0.0)
    target = s.gather(1, safe).squeeze(1)
    loss = torch.where(valid, (lse - target) * scale, 0.0).sum()
    if not with_grads:
        return (loss,)
    # d loss / d s = w (softmax(s) - onehot(y)); the cap's derivative is (c / sqrt(z^2 + c^2))^3.
    g = s.sub_(lse.unsqueeze(1)).exp_().mul_(scale.unsqueeze(1))
    g.scatter_add_(1, safe, -scale.unsqueeze(1))
    if cap:
        g.mul_(inv.mul_(cap).pow_(3))
    grad_bias = g.sum(0) if bias is not None else None
    g_low = g.to(x.dtype)
    return loss, g_low @ weight, g_low, grad_bias  # the weight's gradient, g_low^T x, is added up by the caller


def _kernel_chunk(x, weight, bias, labels, weights, cap: float, ignore_index: int, acc, with_grads: bool, *, impl):
    """`_chunk` through the cross-entropy kernel: the logits stay in x's dtype, and their gradient is
    written over them."""
    valid = labels != ignore_index
    targets = torch.where(valid, labels, -1)
    scale = valid.float() if weights is None else torch.where(valid, weights.float(), 0.0)
    z = F.linear(x, weight, bias)
    rows, lse = softcap_ce_forward(z, targets, scale, cap, impl=impl, what="model.loss_impl")
    loss = rows.sum(dtype=acc)
    if not with_grads:
        return (loss,)
    grad_bias = softcap_ce_backward_(
        z, lse, targets, scale, cap, bias_grad=bias is not None, impl=impl, what="model.loss_impl"
    )
    return loss, z @ weight, z, grad_bias


def add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b for an fp32 `acc` and bf16/fp16 a, b: on CUDA in the matmul itself (its epilogue adds acc
    in fp32), which saves a pass over acc and the product's rounding to bf16. Written into acc (out=acc):
    an out-of-place addmm first copies acc into its result, a 206 MB copy per chunk for the 370M head.

    Returns acc, updated in place."""
    if acc.is_cuda and acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_(a @ b)
