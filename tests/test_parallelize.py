"""FSDP2 wrapping in one process (gloo, one rank): when the blocks' gathered parameters are freed after forward."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from atma_titan.models.atma import ATMA
from atma_titan.models.flavors import FLAVORS
from atma_titan.parallel.dims import ParallelDims
from atma_titan.parallel.parallelize import apply_fsdp, resolve_reshard_after_forward
from distributed_utils import ROOT


def dims(dp_shard: int, dp_replicate: int = 1) -> ParallelDims:
    world = dp_shard * dp_replicate
    return ParallelDims(world_size=world, rank=0, local_rank=0, dp_replicate=dp_replicate, dp_shard=dp_shard)


def test_unset_reshards_only_when_blocks_are_sharded_over_several_ranks():
    assert resolve_reshard_after_forward(None, dims(1)) is False
    assert resolve_reshard_after_forward(None, dims(1, dp_replicate=4)) is False  # replicated, not sharded
    assert resolve_reshard_after_forward(None, dims(8)) is True
    assert resolve_reshard_after_forward(True, dims(1)) is True  # a value given wins
    assert resolve_reshard_after_forward(False, dims(8)) is False


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("setting, gathered_after_forward", [(None, True), (True, False), (False, True)])
def test_a_block_keeps_its_gathered_parameters_after_forward_unless_resharded(
    one_rank_mesh, setting, gathered_after_forward
):
    torch.manual_seed(0)
    model = ATMA(dataclasses.replace(FLAVORS["debug"], n_layers=2))
    one_rank = ParallelDims(1, 0, 0, 1, 1, one_rank_mesh)
    apply_fsdp(model, one_rank, param_dtype=None, reshard_after_forward=setting)
    block = next(iter(model.blocks.values()))
    assert isinstance(next(block.parameters()), DTensor)  # sharded before the first forward
    with torch.no_grad():
        model(torch.randint(0, 512, (1, 16)))
    # FSDP2 swaps a gathered module's parameters to plain tensors and back to DTensor shards on reshard
    assert (not isinstance(next(block.parameters()), DTensor)) == gathered_after_forward


def test_the_hook_benchmark_reports_both_settings(tmp_path):
    out = tmp_path / "hooks.json"
    bench = [sys.executable, str(ROOT / "benchmarks" / "fsdp_hooks.py"), "--layers", "2", "--steps", "1"]
    proc = subprocess.run([*bench, "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"reshard_after_forward=True", "reshard_after_forward=False"}
    for result in results.values():
        assert {"pre_forward", "pre_backward"} <= set(result["hook_ms_per_block"]) and result["step_ms_median"] > 0
