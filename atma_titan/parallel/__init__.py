"""Parallelism: process groups and meshes, the AC + compile + FSDP2 application to a model, and the
gradient norm of sharded gradients."""

from atma_titan.parallel.dims import LaunchEnv, ParallelDims, all_reduce_sum, destroy_distributed, init_distributed
from atma_titan.parallel.grad_norm import clip_coefficient, clip_grads_, total_norm
from atma_titan.parallel.parallelize import parallelize, set_micro_batch

__all__ = [
    "LaunchEnv",
    "ParallelDims",
    "all_reduce_sum",
    "clip_coefficient",
    "clip_grads_",
    "destroy_distributed",
    "init_distributed",
    "parallelize",
    "set_micro_batch",
    "total_norm",
]
