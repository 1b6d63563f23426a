"""One Muon step over a model's block matrices: this Muon (Newton-Schulz batched per shape, its element-wise
passes as two Triton kernels on a GPU, kernels/muon_update), the same with those passes as PyTorch foreach
ops, and torch.optim.Muon (one matrix at a time), same parameters and gradients, one run. Two more rows
take the step with the gradient clip: as a foreach pass over the gradients before a plain step, and as the
trainer takes it, the clip's coefficient (and the NaN policy's skip flag) read inside Muon's kernels.

    python benchmarks/train/optimizer_step.py [--flavor atma_370m] [--out benchmarks/results/]

The matrices are the ones train.py gives Muon (atma_titan.optim.split_parameters), in fp32 on the
GPU (CPU without one) with random gradients. Times are medians of CUDA-synchronised wall times of
whole steps, so the launch overhead that dominates a per-matrix loop is included. On a GPU two more
columns split that time: `gpu_ms`, the device time of a step queued behind a long sleep kernel (the
host's launches hide behind it; null when the host took longer than the sleep), and `host_ms`, how
long the host takes to queue the step. In a
training step the host queues the optimizer right after the step's one sync, so whichever is longer
sets its share of the step.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.models import ATMA  # noqa: E402
from atma_titan.models.flavors import FLAVORS  # noqa: E402
from atma_titan.optim import Muon, scale_grads_, split_parameters  # noqa: E402
from benchmarks.common import result_path, write_json  # noqa: E402


def block_matrices(flavor: str) -> list[torch.Size]:
    with torch.device("meta"):
        model = ATMA(FLAVORS[flavor])
    return [p.shape for p in split_parameters(model)["matrix"]]


SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU clock; a step queued for longer than the sleep gets no gpu_ms


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def plain_step(device: torch.device):
    return lambda opt: opt.step()


def clip_then_step(device: torch.device):
    """The clip as a pass of its own over the gradients, then a plain step (the trainer before the kernels read it)."""
    scale = torch.tensor(0.5, device=device)  # made once: a copy from the host would wait for the sleep below

    def step(opt: Muon) -> None:
        scale_grads_([p.grad for g in opt.param_groups for p in g["params"]], scale)
        opt.step()

    return step


def trainer_step(device: torch.device):
    """A step as the trainer takes it: the clip's coefficient and the NaN policy's skip flag read on the device."""
    scale, skip = torch.tensor(0.5, device=device), torch.tensor(0.0, device=device)
    return lambda opt: opt.step(grad_scale=scale, skip=skip)


def time_steps(optimizer_cls, shapes, device, steps: int, make_step=plain_step) -> dict[str, float]:
    """Median ms of a synchronised step; on a GPU also of its device time and of the host's queueing."""
    step = make_step(device)
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen)
    opt = optimizer_cls(params, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    times = []
    for _ in range(steps + 2):  # two warm-up steps (momentum buffers, cuBLAS handles)
        synchronize(device)
        start = time.perf_counter()
        step(opt)
        synchronize(device)
        times.append(time.perf_counter() - start)
    result = {"step_ms": 1000 * statistics.median(times[2:])}
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        end.record()
        torch.cuda.synchronize()
        sleep_ms = begin.elapsed_time(end)
        device_ms, host_ms = [], []
        for _ in range(steps):
            torch.cuda._sleep(SLEEP_CYCLES)  # the GPU is busy while the host queues the step
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            start = time.perf_counter()
            step(opt)
            host_ms.append(1000 * (time.perf_counter() - start))
            end.record()
            torch.cuda.synchronize()
            device_ms.append(begin.elapsed_time(end))
        # Only while the host queues within the sleep is the device time free of waiting for the host.
        hidden = max(host_ms) < sleep_ms
        result |= {"gpu_ms": statistics.median(device_ms) if hidden else None, "host_ms": statistics.median(host_ms)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="atma_370m", choices=sorted(FLAVORS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = block_matrices(args.flavor)
    print(f"{args.flavor}: {len(shapes)} block matrices, {len(set(shapes))} shapes, on {device}", flush=True)
    rows = []
    variants = (
        ("torch.optim.Muon", torch.optim.Muon, plain_step),
        ("atma_titan Muon, foreach", functools.partial(Muon, elementwise_impl="reference"), plain_step),
        ("atma_titan Muon", Muon, plain_step),
        ("atma_titan Muon, clip pass + step", Muon, clip_then_step),
        ("atma_titan Muon, clip + skip inside", Muon, trainer_step),
    )
    for name, cls, step in variants:
        row = {"optimizer": name, **time_steps(cls, shapes, device, args.steps, step)}
        rows.append(row)
        on_device = "n/a: queued longer than the sleep" if row.get("gpu_ms") is None else f"{row['gpu_ms']:.2f} ms"
        split = f"  (GPU {on_device}, host {row['host_ms']:.2f} ms)" if "host_ms" in row else ""
        speedup = rows[0]["step_ms"] / row["step_ms"]
        print(f"{name:<36} {row['step_ms']:9.2f} ms/step  {speedup:6.2f}x{split}", flush=True)
    result = {"flavor": args.flavor, "device": str(device), "shapes": len(shapes), "rows": rows}
    write_json(result_path("optimizer_step", args.out, None if device.type == "cuda" else "cpu"), result)


if __name__ == "__main__":
    main()
