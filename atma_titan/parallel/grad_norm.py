"""The global gradient norm of FSDP-sharded gradients from their local shards.

`torch.nn.utils.get_total_norm` over DTensors dispatches every per-tensor norm through DTensor on the
host (milliseconds a step at 370M on one GPU). The shards' squared norms add up to the whole's, so one
foreach norm over the local tensors and one all-reduce over the mesh dimensions they are sharded on give
the same norm. Gradients in another layout (a Partial placement, several meshes) take the DTensor path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from atma_titan.optim import local_tensors, scale_grads_

__all__ = ["clip_coefficient", "clip_grads_", "each_norm", "total_norm"]


def _shard_dims(grads: list[torch.Tensor]) -> list[int] | None:
    """The mesh dimensions all `grads` are sharded on; None if they are not all Shard/Replicate DTensors of
    one mesh and one placement (then the DTensor path is the safe one)."""
    if not all(isinstance(g, DTensor) for g in grads):
        return None
    mesh, placements = grads[0].device_mesh, grads[0].placements
    if any(g.device_mesh != mesh or g.placements != placements for g in grads):
        return None
    if not all(isinstance(p, (Shard, Replicate)) for p in placements):
        return None
    return [dim for dim, p in enumerate(placements) if isinstance(p, Shard)]


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `grads` together, as a plain tensor (the same on every rank)."""
    if not grads:
        return torch.zeros(())
    dims = _shard_dims(grads)
    if dims is None:
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    mesh = grads[0].device_mesh
    squared = torch.nn.utils.get_total_norm(local_tensors(grads)).square()
    for dim in dims:
        if mesh.size(dim) > 1:
            dist.all_reduce(squared, group=mesh.get_group(dim))
    return squared.sqrt()


def each_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each of `grads`, as one plain float32 tensor (the same on every rank; collective when sharded)."""
    if not grads:
        return torch.zeros(0)
    dims = _shard_dims(grads)
    if dims is None:
        full = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
        return torch.stack([n.float() for n in torch._foreach_norm(full)])
    mesh = grads[0].device_mesh
    squared = torch.stack([n.float() for n in torch._foreach_norm(local_tensors(grads))]).square()
    for dim in dims:
        if mesh.size(dim) > 1:
            dist.all_reduce(squared, group=mesh.get_group(dim))
    return squared.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What `torch.nn.utils.clip_grads_with_norm_` multiplies gradients by so that their total norm `norm`
    is at most `max_norm` (1 when it already is), as a tensor beside `norm`: no host sync."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_grads_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale `grads` in place so that their total norm `norm` is at most `max_norm`, as
    `torch.nn.utils.clip_grads_with_norm_` does, on the local shards in one foreach launch."""
    scale_grads_(grads, clip_coefficient(norm, max_norm))
