"""Apply activation checkpointing, torch.compile and FSDP2 to an ATMA model, in torchtitan's order.

AC wraps each block, compile wraps each (wrapped) block with fullgraph=True, and fully_shard goes
around each compiled block, the embedding, the final norm + head, and the root. FSDP's hooks thus
stay outside the compiled graphs, and a graph break inside a block is an error.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import atma_titan.kernels.gated_delta.ops  # noqa: F401  (registers torch.ops.atma.* for the policy)
import atma_titan.kernels.polar.ops  # noqa: F401
from atma_titan.parallel.dims import ParallelDims

# Selective AC: a per-op policy inside each block. The outputs of the costly ops are kept; the cheap
# elementwise rest (norms, gates, activations, residual adds) is recomputed in backward.
_KERNEL_OPS = {  # attention and memory: the costliest ops to recompute
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten.linalg_solve_triangular.default,  # the gated-delta reference's chunk solve
    torch.ops.atma.polar_attention_fwd.default,
    torch.ops.atma.gated_delta_chunk_fwd.default,
}
_MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def matmul_width(op, args) -> int:
    """The output width (last dimension) of a matmul op from its inputs: mm(a, b), addmm(bias, a, b), bmm(a, b)."""
    b = args[2] if op is torch.ops.aten.addmm.default else args[1]
    return b.shape[-1]


def selective_policy(max_saved_width: int | None = None):
    """Keep the kernels' and the matmuls' outputs, but recompute the matmuls whose output is wider than
    `max_saved_width` (when given). Returns the policy function of create_selective_checkpoint_contexts."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in _KERNEL_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in _MATMUL_OPS and (max_saved_width is None or matmul_width(op, args) <= max_saved_width):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# What selective AC keeps besides the kernels' outputs: every matmul's output (nothing repeated), those at
# most 4 x d_model wide (the MLP's up-projection, 8 x d_model, is recomputed: ~half the memory for ~16%
# more matmul FLOPs at 370M), or none (every matmul recomputed). benchmarks/train/activation_memory.py measures them.
SELECTIVE_SAVES = ("matmuls", "narrow_matmuls", "kernels")


# Which blocks AC wraps: all, only the global (attention + memory) ones, or only the local (convolution) ones.
AC_BLOCKS = {
    "all": lambda block: True,
    "global": lambda block: block.is_global,
    "local": lambda block: not block.is_global,
}


def apply_activation_checkpointing(
    model: nn.Module, mode: str, every_n: int = 1, save: str = "matmuls", blocks: str = "all"
) -> None:
    """mode: none | full (every `every_n`-th block recomputed whole) | selective (op-level, keeping the
    kernels' outputs and the `save` matmuls' outputs); either only in the `blocks` (AC_BLOCKS) chosen."""
    if mode == "none":
        return
    max_saved_width = {"matmuls": None, "narrow_matmuls": 4 * model.args.d_model, "kernels": 0}[save]
    policy = selective_policy(max_saved_width)
    for i, (name, block) in enumerate(list(model.blocks.items())):
        if not AC_BLOCKS[blocks](block):
            continue
        if mode == "full" and i % every_n == 0:
            model.blocks[name] = checkpoint_wrapper(block, preserve_rng_state=True)
        elif mode == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, policy)
            model.blocks[name] = checkpoint_wrapper(block, context_fn=context, preserve_rng_state=True)


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """Compile each block, the final norm and the head on their own (fullgraph). The final norm too: run
    eagerly, its fp32 forward and backward are 13 kernels over the (tokens x d) activations, 1.46 ms a
    micro-batch of 32K tokens at 370M on the H200 (measured 2026-12-03), where compiled they fuse."""
    for name, block in list(model.blocks.items()):
        model.blocks[name] = torch.compile(block, fullgraph=True, backend=backend)
    model.norm = torch.compile(model.norm, fullgraph=True, backend=backend)
    model.head = torch.compile(model.head, fullgraph=True, backend=backend)


def resolve_reshard_after_forward(reshard_after_forward: bool | None, dims: ParallelDims) -> bool:
    """`parallelism.reshard_after_forward`, unset: reshard only when the blocks are sharded over several ranks.
    At dp_shard = 1 a rank holds every parameter whole: resharding would free only the gathered (bf16) copy
    and pay for it with a second gather and FSDP's pre-backward hook in every block's backward."""
    return dims.dp_shard > 1 if reshard_after_forward is None else reshard_after_forward


def apply_fsdp(
    model: nn.Module, dims: ParallelDims, *, param_dtype: torch.dtype | None, reshard_after_forward: bool | None = None
) -> None:
    reshard_after_forward = resolve_reshard_after_forward(reshard_after_forward, dims)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    shard = dict(mesh=dims.dp_mesh, mp_policy=mp)
    fully_shard(model.embed, **shard, reshard_after_forward=reshard_after_forward)
    for block in model.blocks.values():
        fully_shard(block, **shard, reshard_after_forward=reshard_after_forward)
    # The head runs last in forward and first in backward: keeping it unsharded saves one all-gather.
    fully_shard([model.norm, model.head], **shard, reshard_after_forward=False)
    fully_shard(model, **shard, reshard_after_forward=reshard_after_forward)


def set_micro_batch(model: nn.Module, last: bool) -> None:
    """Before each micro-batch of a step on an FSDP2 model: gradients are reduce-scattered only after the last
    one, and until then the parameters a backward gathered stay gathered, so the next micro-batch's forward
    does not gather them again (one all-gather per block and micro-batch fewer, for at most one bf16 copy
    of the parameters held between micro-batches); the last backward frees them for the optimizer step."""
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    ac_mode: str = "none",
    ac_every_n: int = 1,
    ac_save: str = "matmuls",
    ac_blocks: str = "all",
    compile: bool = False,
    compile_backend: str = "inductor",
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    apply_activation_checkpointing(model, ac_mode, ac_every_n, ac_save, ac_blocks)
    if compile:
        apply_compile(model, compile_backend)
    if dims.distributed:
        apply_fsdp(model, dims, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward)
    return model
