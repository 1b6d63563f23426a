"""Apply activation checkpointing, torch.compile and FSDP2 to an ATMA model, in torchtitan's order.

AC wraps each block, compile wraps each (wrapped) block with fullgraph=True, and fully_shard goes
around each compiled block, the embedding, the final norm + head, and the root. FSDP's hooks thus
stay outside the compiled graphs, and a graph break inside a block is an error.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from atma_titan.parallel.dims import ParallelDims

# Selective AC keeps the outputs of the expensive ops and recomputes the cheap elementwise rest.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten.linalg_solve_triangular.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: nn.Module, mode: str, every_n: int = 1) -> None:
    """mode: none | full (every `every_n`-th block recomputed whole) | selective (op-level, every block)."""
    if mode == "none":
        return
    for i, (name, block) in enumerate(list(model.blocks.items())):
        if mode == "full" and i % every_n == 0:
            model.blocks[name] = checkpoint_wrapper(block, preserve_rng_state=True)
        elif mode == "selective":
            model.blocks[name] = checkpoint_wrapper(block, context_fn=_selective_context, preserve_rng_state=True)


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    for name, block in list(model.blocks.items()):
        model.blocks[name] = torch.compile(block, fullgraph=True, backend=backend)
    model.head = torch.compile(model.head, fullgraph=True, backend=backend)


def apply_fsdp(
    model: nn.Module, dims: ParallelDims, *, param_dtype: torch.dtype | None, reshard_after_forward: bool = True
) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    shard = dict(mesh=dims.dp_mesh, mp_policy=mp)
    fully_shard(model.embed, **shard, reshard_after_forward=reshard_after_forward)
    for block in model.blocks.values():
        fully_shard(block, **shard, reshard_after_forward=reshard_after_forward)
    # The head runs last in forward and first in backward: keeping it unsharded saves one all-gather.
    fully_shard([model.norm, model.head], **shard, reshard_after_forward=False)
    fully_shard(model, **shard, reshard_after_forward=reshard_after_forward)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    ac_mode: str = "none",
    ac_every_n: int = 1,
    compile: bool = False,
    compile_backend: str = "inductor",
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    apply_activation_checkpointing(model, ac_mode, ac_every_n)
    if compile:
        apply_compile(model, compile_backend)
    if dims.distributed:
        apply_fsdp(model, dims, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward)
    return model
