"""FSDP2 wrapping (when blocks are resharded after forward) and the gradient norm from local shards (1-4 gloo ranks)."""

import copy
import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from atma_titan.models.atma import ATMA
from atma_titan.models.flavors import FLAVORS
from atma_titan.parallel.dims import ParallelDims
from atma_titan.parallel.parallelize import apply_compile, apply_fsdp, resolve_reshard_after_forward, set_micro_batch
from distributed_utils import ROOT, run_gloo_script


def dims(dp_shard: int, dp_replicate: int = 1) -> ParallelDims:
    world = dp_shard * dp_replicate
    return ParallelDims(world_size=world, rank=0, local_rank=0, dp_replicate=dp_replicate, dp_shard=dp_shard)


def test_unset_reshards_only_when_blocks_are_sharded_over_several_ranks():
    assert resolve_reshard_after_forward(None, dims(1)) is False
    assert resolve_reshard_after_forward(None, dims(1, dp_replicate=4)) is False  # replicated, not sharded
    assert resolve_reshard_after_forward(None, dims(8)) is True
    assert resolve_reshard_after_forward(True, dims(1)) is True  # a value given wins
    assert resolve_reshard_after_forward(False, dims(8)) is False


def test_compile_wraps_every_module_after_the_embedding_and_keeps_the_outputs():
    """The blocks, the final norm and the head each run compiled (the norm eagerly was ~13 kernels a
    micro-batch); the embedding lookup alone stays eager. Outputs and gradients are the eager model's."""
    torch.manual_seed(0)
    eager = ATMA(dataclasses.replace(FLAVORS["debug"], n_layers=2))
    eager.init_weights()
    torch.nn.init.normal_(eager.head.weight, std=0.02)  # a zero head would give zero gradients below
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, backend="aot_eager")
    wrapped = [compiled.norm, compiled.head, *compiled.blocks.values()]
    assert all(hasattr(module, "_orig_mod") for module in wrapped)
    assert not hasattr(compiled.embed, "_orig_mod")
    tokens = torch.randint(0, 512, (2, 16))
    outputs = [model(tokens) for model in (eager, compiled)]
    torch.testing.assert_close(outputs[1], outputs[0])
    for model, out in zip((eager, compiled), outputs):
        out.square().mean().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.fixture
def one_rank_mesh(one_rank_gloo):
    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))


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
    bench = [sys.executable, str(ROOT / "benchmarks" / "train" / "fsdp_hooks.py"), "--layers", "2", "--steps", "1"]
    proc = subprocess.run([*bench, "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"reshard_after_forward=True", "reshard_after_forward=False"}
    for result in results.values():
        assert {"pre_forward", "pre_backward"} <= set(result["hook_ms_per_block"]) and result["step_ms_median"] > 0


GRAD_NORM_SCRIPT = r"""
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from atma_titan.parallel import grad_norm

SHAPES = [(20, 12), (16, 12), (6, 20), (3, 8), (40, 5), (1, 7)]  # uneven rows, fewer rows than ranks

def make():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(cols, rows, bias=rows % 2 == 0) for rows, cols in SHAPES))

dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
full = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float32)
        for i, p in enumerate(make().parameters())]
reference = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in full]))
result = {"reference": reference.item()}
layouts = {"plain": None, "fsdp": (world,), "hsdp": (2, world // 2) if world > 1 else (1, 1)}
for name, shape in layouts.items():
    model = make()
    if shape is not None:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    grads = [distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g.clone()
             for g, p in zip(full, model.parameters())]
    local_path = grad_norm._shard_dims(grads) is not None
    norm = grad_norm.total_norm(grads)
    grad_norm.clip_grads_(grads, 0.5 * reference.item(), norm)
    clipped = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
    expected = [g * torch.clamp(0.5 * reference / (norm.double() + 1e-6), max=1.0).float() for g in full]
    norms = [None] * world
    dist.all_gather_object(norms, norm.item())
    result[name] = {
        "local_path": local_path,
        "norms": norms,
        "clipped_equal": all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(clipped, expected)),
    }
"""


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_norm_of_local_shards_is_the_whole_gradients_norm(tmp_path, world):
    result = run_gloo_script(GRAD_NORM_SCRIPT, world, tmp_path)
    for name in ("plain", "fsdp", "hsdp"):
        r = result[name]
        assert r["local_path"] == (name != "plain"), name  # FSDP's shards skip the DTensor dispatch
        assert r["norms"] == [r["norms"][0]] * world, name  # every rank clips by the same norm
        assert r["norms"][0] == pytest.approx(result["reference"], rel=1e-6), name
        assert r["clipped_equal"], name


def test_parameters_stay_gathered_between_micro_batches_and_are_freed_after_the_last(one_rank_mesh):
    torch.manual_seed(0)
    model = ATMA(dataclasses.replace(FLAVORS["debug"], n_layers=2))
    apply_fsdp(model, ParallelDims(1, 0, 0, 1, 1, one_rank_mesh), param_dtype=None, reshard_after_forward=True)
    block = next(iter(model.blocks.values()))
    tokens = torch.randint(0, 512, (1, 16))
    gathered = []
    for micro in range(3):
        set_micro_batch(model, last=micro == 2)
        model(tokens).float().square().mean().backward()
        gathered.append(not isinstance(next(block.parameters()), DTensor))
    # kept after the backward of micro-batches 0 and 1 (the next forward needs no all-gather), freed after the last
    assert gathered == [True, True, False]
    assert all(isinstance(p, DTensor) and p.grad is not None for p in model.parameters())
