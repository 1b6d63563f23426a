"""Newton-Schulz work per rank under sharded Muon, from the model's shapes alone (CPU, meta device).

    python benchmarks/train/muon_ownership.py [--config train_configs/atma_370m.toml] [--worlds 8,64]
    python benchmarks/train/muon_ownership.py --batch-invariance     # on a GPU: the bits check below

Muon gives each block matrix one owner rank (atma_titan.optim.assign_owners); before, every rank
orthogonalised every matrix. For each world size this prints the Newton-Schulz FLOPs per step of the
busiest, the mean and the idlest rank next to that old every-rank total, and the elements each rank
receives per step (the old all-gather of fp32 updates against the two bf16 all-to-alls), and saves
benchmarks/results/muon_ownership-cpu-<date>.json. The model is built on the meta device: no weights.

--batch-invariance (GPU, one command for the lead) orthogonalises random matrices of the model's
shapes on the device, all of one shape in one batch and then in each owner's batch at each world size,
and records whether every matrix came out bit-equal (sharded Muon equals single-process Muon only if
so; the ranks agree with each other either way) in benchmarks/results/muon_batch_invariance-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.config import load_config  # noqa: E402
from atma_titan.models import ATMA, resolve_model_args  # noqa: E402
from atma_titan.optim import ShardExchange, assign_owners, orthogonalize_all, split_parameters  # noqa: E402
from benchmarks.common import result_path, write_json  # noqa: E402


def block_matrix_shapes(config: str) -> tuple[list[tuple[int, int]], int, str]:
    """The shapes of the matrices train.py gives Muon, its Newton-Schulz steps, and the flavor."""
    cfg = load_config(["--config", config])
    with torch.device("meta"):
        model = ATMA(resolve_model_args(cfg.model))
    shapes = [tuple(p.shape) for p in split_parameters(model)["matrix"]]
    return shapes, cfg.optimizer.muon_ns_steps, cfg.model.flavor


def received_elements(shapes: list[tuple[int, int]], world: int, steps: int) -> list[int]:
    """Elements each rank receives per step in the two all-to-alls (others' shards of the matrices it
    owns, then its rows of the matrices others own)."""
    out = []
    for rank in range(world):
        plan = ShardExchange.plan(tuple(shapes), world, rank, steps)
        out.append(sum(plan.from_ranks) - plan.from_ranks[rank] + sum(plan.to_owner) - plan.to_owner[rank])
    return out


def ownership_row(shapes: list[tuple[int, int]], world: int, steps: int) -> dict:
    ownership = assign_owners(shapes, world, steps)
    flops = ownership.rank_flops
    received = received_elements(shapes, world, steps)
    numel = sum(r * c for r, c in shapes)
    return {
        "world_size": world,
        "ns_gflops_max": max(flops) / 1e9,
        "ns_gflops_mean": statistics.mean(flops) / 1e9,
        "ns_gflops_min": min(flops) / 1e9,
        "ns_gflops_every_rank_before": ownership.total_flops / 1e9,
        "speedup_of_busiest_rank": ownership.total_flops / max(flops),
        "imbalance_max_over_mean": max(flops) / statistics.mean(flops),
        "matrices_per_rank_max": max(ownership.owners.count(r) for r in range(world)),
        "received_melements_max_bf16": max(received) / 1e6,
        "received_melements_before_fp32": numel * (world - 1) / world / 1e6,  # the all-gather of every update
    }


def batch_invariance(shapes: list[tuple[int, int]], worlds: list[int], steps: int, device: torch.device) -> dict:
    """Per world size: is every matrix's result from its owner's batch bit-equal to the one-batch result?"""
    gen = torch.Generator(device=device).manual_seed(0)
    updates = [torch.randn(s, device=device, generator=gen) for s in shapes]
    reference = orthogonalize_all(updates, steps, 1e-7)
    rows = []
    for world in [1, *worlds]:
        owners = assign_owners(shapes, world, steps).owners
        worst, equal = 0.0, 0
        for rank in range(world):
            mine = [i for i, o in enumerate(owners) if o == rank]
            for i, x in zip(mine, orthogonalize_all([updates[i] for i in mine], steps, 1e-7)):
                equal += bool(torch.equal(x, reference[i]))
                worst = max(worst, (x.float() - reference[i].float()).abs().max().item())
        rows.append({"world_size": world, "bit_equal": equal, "matrices": len(shapes), "max_abs_diff": worst})
        print(f"world {world:>3}: {equal}/{len(shapes)} matrices bit-equal, max |diff| {worst:.3g}", flush=True)
    return {"device": str(device), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/atma_370m.toml")
    parser.add_argument("--worlds", default="8,64", help="comma-separated world sizes (ranks of one shard group)")
    parser.add_argument("--batch-invariance", action="store_true", help="run the GPU bits check instead")
    parser.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    args = parser.parse_args()
    shapes, steps, flavor = block_matrix_shapes(args.config)
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"{flavor}: {len(shapes)} block matrices, {len(set(shapes))} shapes, {steps} Newton-Schulz steps", flush=True)
    if args.batch_invariance:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        result = {"flavor": flavor, **batch_invariance(shapes, worlds, steps, device)}
        path = result_path("muon_batch_invariance", args.out, None if device.type == "cuda" else "cpu")
    else:
        rows = [ownership_row(shapes, w, steps) for w in worlds]
        print(f"{'ranks':>5} {'max':>8} {'mean':>8} {'min':>8} {'before':>9} {'speedup':>8}  (GFLOP / step / rank)")
        for r in rows:
            print(
                f"{r['world_size']:>5} {r['ns_gflops_max']:8.1f} {r['ns_gflops_mean']:8.1f} {r['ns_gflops_min']:8.1f}"
                f" {r['ns_gflops_every_rank_before']:9.1f} {r['speedup_of_busiest_rank']:7.2f}x",
                flush=True,
            )
        result = {"flavor": flavor, "matrices": len(shapes), "ns_steps": steps, "rows": rows}
        path = result_path("muon_ownership", args.out, "cpu")
    write_json(path, result)


if __name__ == "__main__":
    main()
