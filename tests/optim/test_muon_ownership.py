"""Sharded Muon: one owner rank orthogonalises each matrix (atma_titan.optim.Muon, assign_owners)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from atma_titan import optim
from atma_titan.optim import assign_owners, newton_schulz_flops, orthogonalize_all, shard_rows
from distributed_utils import run_gloo_script


def test_newton_schulz_flops_counts_the_products_orthogonalize_runs():
    for shape in [(24, 16), (16, 24), (7, 7), (1024, 3)]:
        with FlopCounterMode(display=False) as counter:
            optim.orthogonalize(torch.randn(shape), 5)
        assert counter.get_total_flops() == newton_schulz_flops(shape, 5), shape


def test_owners_balance_flops_deterministically():
    shapes = [(64, 64)] * 6 + [(256, 64)] * 4 + [(64, 3)] * 5 + [(8, 64)]
    a = assign_owners(shapes, 4)
    assert a == assign_owners([tuple(s) for s in shapes], 4)  # from the shapes alone, the same every time
    assert len(a.owners) == len(shapes) and set(a.owners) <= set(range(4))
    costs = [newton_schulz_flops(s, 5) for s in shapes]
    assert a.total_flops == sum(costs)
    assert sum(a.rank_flops) == sum(costs) and max(a.rank_flops) <= sum(costs) / 4 + max(costs)
    assert max(a.rank_flops) < 0.3 * a.total_flops
    for rank, flops in enumerate(a.rank_flops):
        assert flops == sum(c for c, o in zip(costs, a.owners) if o == rank)
    one = assign_owners(shapes, 1)
    assert set(one.owners) == {0} and one.rank_flops == (a.total_flops,)
    many = assign_owners(shapes, 64)  # more ranks than matrices: each matrix its own owner, some ranks idle
    assert len(set(many.owners)) == len(shapes) and many.rank_flops.count(0) == 64 - len(shapes)
    with pytest.raises(ValueError, match="world_size"):
        assign_owners(shapes, 0)


def test_shard_rows_is_torch_chunks_split():
    for rows in range(0, 13):
        for world in range(1, 7):
            chunks = [len(c) for c in torch.arange(rows).chunk(world)]
            assert shard_rows(rows, world) == chunks + [0] * (world - len(chunks)), (rows, world)


def test_orthogonalized_matrix_does_not_depend_on_its_batch(monkeypatch):
    """The owner of a matrix batches it with other matrices than a single process does."""
    torch.manual_seed(0)
    updates = [torch.randn(24, 16) for _ in range(6)] + [torch.randn(40, 5) for _ in range(3)]
    everything = orthogonalize_all(updates, 5, 1e-7)
    for subset in ([0], [5, 2], [1, 3, 4], [8, 0, 6], [7]):
        for i, x in zip(subset, orthogonalize_all([updates[i] for i in subset], 5, 1e-7)):
            assert torch.equal(x, everything[i]), (subset, i)
    monkeypatch.setattr(optim.newton_schulz, "MAX_BATCH_ELEMENTS", 2 * 24 * 16)  # batches of 2, 2, 2
    for x, y in zip(orthogonalize_all(updates, 5, 1e-7), everything):
        assert torch.equal(x, y)


SCRIPT = r"""
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from atma_titan import optim

# Repeated shapes (batched differently by owners and by one process), rows not divisible by 4, fewer
# rows than ranks (empty shards), tall and wide.
SHAPES = [(20, 12), (16, 12), (16, 12), (16, 12), (6, 20), (3, 8), (40, 5), (5, 40), (16, 12)]
STEPS = 3

def make():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(cols, rows, bias=False) for rows, cols in SHAPES))

def train(model):
    opt = optim.Muon(model.parameters(), lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
        opt.step()
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]

counts = {"matrices": 0, "all_to_all": 0}
real_orthogonalize, real_a2a = optim.orthogonalize, dist.all_to_all_single
def counting_orthogonalize(x, *args):
    counts["matrices"] += x.shape[0] if x.dim() == 3 else 1
    return real_orthogonalize(x, *args)
def counting_a2a(*args, **kwargs):
    counts["all_to_all"] += 1
    return real_a2a(*args, **kwargs)

dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
reference = train(make())  # single-process Muon on plain tensors
optim.newton_schulz.orthogonalize, dist.all_to_all_single = counting_orthogonalize, counting_a2a
result = {"world": world}
layouts = {"fsdp": (world,), "hsdp": (2, world // 2) if world > 1 else (1, 1), "columns": (world,)}
for name, mesh_shape in layouts.items():
    counts.update(matrices=0, all_to_all=0)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape) :])
    if name == "columns":  # not rows: all-gathered on every rank
        by_columns = [distribute_tensor(w.detach(), mesh, [Shard(1)]) for w in make().parameters()]
        model = nn.ParameterList(nn.Parameter(w) for w in by_columns)
    else:
        model = make()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    placements = [tuple(repr(p) for p in q.placements) for q in model.parameters()]
    params = train(model)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, dict(counts))
    result[name] = {
        "equal": [bool(torch.equal(a, b)) for a, b in zip(reference, params)],
        "placements": placements[0],
        "matrices_per_rank": [c["matrices"] for c in per_rank],
        "all_to_all_per_rank": [c["all_to_all"] for c in per_rank],
        "local_rows_rank0": [q.to_local().shape[0] for q in model.parameters()],
    }
"""


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_muon_equals_single_process_muon_and_each_matrix_has_one_owner(tmp_path, world):
    result = run_gloo_script(SCRIPT, world, tmp_path)
    n, steps = 9, 3
    columns = result["columns"]
    assert all(columns["equal"]) and columns["placements"] == ["Shard(dim=1)"]
    assert columns["matrices_per_rank"] == [n * steps] * world and columns["all_to_all_per_rank"] == [0] * world
    for name in ("fsdp", "hsdp"):
        r = result[name]
        assert all(r["equal"]), (name, r["equal"])  # bit-equal to single-process Muon
        shard_ranks = world if name == "fsdp" else max(1, world // 2)
        assert r["placements"][-1] == "Shard(dim=0)" and len(r["placements"]) == (1 if name == "fsdp" else 2)
        # Each matrix is orthogonalised once per shard group and step, by its owner only.
        assert sum(r["matrices_per_rank"]) == n * steps * (world // shard_ranks), r
        if shard_ranks > 1:
            assert max(r["matrices_per_rank"]) < n * steps, r
            assert r["all_to_all_per_rank"] == [2 * steps] * world, r  # two collectives a step
        else:
            assert r["all_to_all_per_rank"] == [0] * world, r
    if world == 4:
        assert result["fsdp"]["local_rows_rank0"][4:6] == [2, 1]  # the 6- and 3-row matrices: uneven shards
