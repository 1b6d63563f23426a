"""One Muon step over a model's block matrices: this Muon (Newton-Schulz batched per shape, foreach
momentum) against torch.optim.Muon (one matrix at a time), same parameters and gradients, one run.

    python benchmarks/optimizer_step.py [--flavor atma_370m] [--out benchmarks/results/]

The matrices are the ones train.py gives Muon (atma_titan.optim.split_parameters), in fp32 on the
GPU (CPU without one) with random gradients. Times are medians of CUDA-synchronised wall times of
whole steps, so the launch overhead that dominates a per-matrix loop is included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from atma_titan.models import ATMA
from atma_titan.models.flavors import FLAVORS
from atma_titan.optim import Muon, split_parameters


def block_matrices(flavor: str) -> list[torch.Size]:
    with torch.device("meta"):
        model = ATMA(FLAVORS[flavor])
    return [p.shape for p in split_parameters(model)["matrix"]]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(optimizer_cls, shapes, device, steps: int) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen)
    opt = optimizer_cls(params, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    times = []
    for _ in range(steps + 2):  # two warm-up steps (momentum buffers, cuBLAS handles)
        synchronize(device)
        start = time.perf_counter()
        opt.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="atma_370m", choices=sorted(FLAVORS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = block_matrices(args.flavor)
    print(f"{args.flavor}: {len(shapes)} block matrices, {len(set(shapes))} shapes, on {device}", flush=True)
    rows = []
    for name, cls in (("torch.optim.Muon", torch.optim.Muon), ("atma_titan Muon", Muon)):
        ms = time_steps(cls, shapes, device, args.steps)
        rows.append({"optimizer": name, "step_ms": ms})
        print(f"{name:<18} {ms:9.2f} ms/step  {rows[0]['step_ms'] / ms:6.2f}x", flush=True)
    gpu = torch.cuda.get_device_name().split()[-1].lower() if device.type == "cuda" else "cpu"
    path = Path(args.out) / f"optimizer_step-{gpu}-{args.flavor}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"flavor": args.flavor, "device": str(device), "shapes": len(shapes), "rows": rows}, indent=2)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
