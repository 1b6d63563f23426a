"""Host time of FSDP2's hooks per block at one rank, with and without resharding after forward.

    python benchmarks/train/fsdp_hooks.py [--flavor debug] [--layers 8] [--device cpu|cuda] [--steps 5] [--out FILE]

One process forms a one-rank group (gloo on CPU, NCCL on CUDA) and wraps the model as the trainer
does (`apply_fsdp`). It profiles `--steps` forward+backward steps under each setting of
`parallelism.reshard_after_forward`. It prints the host (CPU) time of each `FSDP::` hook kind per
block and step, and the wall time of a step. Results go to
benchmarks/results/fsdp_hooks-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.models.atma import ATMA  # noqa: E402
from atma_titan.models.flavors import FLAVORS  # noqa: E402
from atma_titan.parallel.dims import ParallelDims  # noqa: E402
from atma_titan.parallel.parallelize import apply_fsdp  # noqa: E402
from benchmarks.common import result_path, write_json  # noqa: E402


def hook_kind(event_name: str) -> str | None:
    """'FSDP::pre_backward (blocks.3)' -> 'pre_backward' for a block's hooks; None for the others."""
    if not event_name.startswith("FSDP::") or "(blocks." not in event_name:
        return None
    return event_name.removeprefix("FSDP::").split(" ")[0]


def measure(args, device: torch.device, mesh, reshard: bool) -> dict:
    torch.manual_seed(0)
    model_args = dataclasses.replace(FLAVORS[args.flavor], n_layers=args.layers)
    model = ATMA(model_args).to(device)
    param_dtype = torch.bfloat16 if device.type == "cuda" else None
    apply_fsdp(model, ParallelDims(1, 0, 0, 1, 1, mesh), param_dtype=param_dtype, reshard_after_forward=reshard)
    tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq_len), device=device)

    def step() -> None:
        model(tokens).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):  # warm-up: lazy init, first gathers
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    per_block = defaultdict(float)
    for event in prof.key_averages():
        kind = hook_kind(event.key)
        if kind:
            per_block[kind] += event.cpu_time_total / 1000 / args.steps / args.layers  # ms per block a step
    walls = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        walls.append((time.perf_counter() - start) * 1000)
    return {"hook_ms_per_block": dict(sorted(per_block.items())), "step_ms_median": statistics.median(walls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debug", choices=sorted(FLAVORS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", help="a results folder or a .json file")
    args = parser.parse_args()

    device = torch.device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        results = {f"reshard_after_forward={r}": measure(args, device, mesh, r) for r in (True, False)}
    finally:
        dist.destroy_process_group()

    kinds = sorted({k for r in results.values() for k in r["hook_ms_per_block"]})
    shape = f"{args.batch} x {args.seq_len}"
    print(f"{args.flavor}, {args.layers} blocks, {shape} on {device} (one rank), {args.steps} steps")
    print(f"{'host ms per block a step':28s}" + "".join(f"{name:>30s}" for name in results))
    for kind in kinds:
        print(f"{kind:28s}" + "".join(f"{r['hook_ms_per_block'].get(kind, 0.0):30.3f}" for r in results.values()))
    print(f"{'step wall ms (median)':28s}" + "".join(f"{r['step_ms_median']:30.1f}" for r in results.values()))
    path = result_path("fsdp_hooks", args.out, None if device.type == "cuda" else "cpu")
    write_json(path, {"args": vars(args), "torch": torch.__version__, "results": results})


if __name__ == "__main__":
    main()
