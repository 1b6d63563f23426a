"""Process groups and the data-parallel device mesh, initialised from torchrun's environment.

The mesh has two data-parallel dimensions, `dp_replicate` x `dp_shard`: FSDP shards parameters
over `dp_shard` and, when `dp_replicate` > 1, replicates those shards (HSDP) — one config change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from atma_titan.utils.errors import InputError


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun tells this process (RANK, WORLD_SIZE, LOCAL_RANK), read once.

    `launched` is False for a plain `python -m atma_titan.train` (no WORLD_SIZE in the environment)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    launched: bool = False

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        env = os.environ
        return cls(
            int(env.get("WORLD_SIZE", 1)), int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), "WORLD_SIZE" in env
        )


@dataclass
class ParallelDims:
    world_size: int
    rank: int
    local_rank: int
    dp_replicate: int
    dp_shard: int
    mesh: DeviceMesh | None = None

    @property
    def distributed(self) -> bool:
        """True under torchrun (even with one rank): the model is sharded with FSDP2."""
        return self.mesh is not None

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        if self.mesh is None:
            return None
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp_shard"]

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        return self.rank  # data parallelism is the only dimension, so the DP rank is the global rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_degrees(world_size: int, dp_replicate: int, dp_shard: int) -> tuple[int, int]:
    """Fill in dp_shard = -1 and check that the degrees multiply to the world size."""
    if dp_replicate < 1:
        raise InputError(f"'parallelism.dp_replicate' = {dp_replicate} is invalid; allowed: an integer >= 1")
    if dp_shard == -1:
        if world_size % dp_replicate:
            raise InputError(
                f"'parallelism.dp_replicate' = {dp_replicate} does not divide the world size "
                f"{world_size}; allowed: a divisor of the number of ranks"
            )
        dp_shard = world_size // dp_replicate
    if dp_shard < 1 or dp_replicate * dp_shard != world_size:
        raise InputError(
            f"'parallelism.dp_replicate' x 'parallelism.dp_shard' = {dp_replicate} x {dp_shard} must "
            f"equal the world size {world_size}; set dp_shard = -1 to use every remaining rank"
        )
    return dp_replicate, dp_shard


def init_distributed(
    env: LaunchEnv, dp_replicate: int, dp_shard: int, device_type: str, timeout_s: int = 600
) -> ParallelDims:
    """Start NCCL (CUDA) or gloo (CPU) process groups and the mesh under torchrun.

    A plain `python -m atma_titan.train` (not `env.launched`) runs without process groups or FSDP; under
    torchrun the model is always FSDP-sharded, with one rank too, so one GPU runs the cluster code path.
    """
    dp_replicate, dp_shard = resolve_degrees(env.world_size, dp_replicate, dp_shard)
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
    dims = ParallelDims(env.world_size, env.rank, env.local_rank, dp_replicate, dp_shard)
    if env.launched:
        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        dims.mesh = init_device_mesh(device_type, (dp_replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    return dims


def all_reduce_sum(values: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Sum `values` in place over all ranks (a no-op in a single process)."""
    if dims.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_gather_objects(obj):
    """`obj` of every rank, in rank order, over the default process group; [obj] in a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
