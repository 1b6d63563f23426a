"""Parallelism: process groups and meshes, and the AC + compile + FSDP2 application to a model."""

from atma_titan.parallel.dims import LaunchEnv, ParallelDims, all_reduce_sum, destroy_distributed, init_distributed
from atma_titan.parallel.parallelize import parallelize

__all__ = ["LaunchEnv", "ParallelDims", "all_reduce_sum", "destroy_distributed", "init_distributed", "parallelize"]
