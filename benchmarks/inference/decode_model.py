"""Whole-model generation speed on one GPU: decode tokens/s against the step's bandwidth floor, and prefill.

    python benchmarks/inference/decode_model.py [--flavor atma_370m] [--batches 1,8,64] [--contexts 2K,32K]
                                                [--prefill 2K,32K] [--runs 5] [--steps 20] [--modes ...]
                                                [--out benchmarks/results/]

The model has random weights (speed does not depend on them), Linear weights in bf16 as the
generate command loads them. Decode: every sequence of the batch holds `context` tokens in its
pages (random keys and values written straight into the pool: prefilling 64 x 32K tokens would
take longer than all the decode timing) and one more token is fed per step; the step is timed
inside the engine's CUDA graph and eagerly, `--steps` steps per timing, median of `--runs`; then
again with the greedy tokens taken to the host after every step, as the generation loop does (the
host then waits for each step).

The floor of a step is the bytes it must move over the copy bandwidth measured in the same run
(dst.copy_(src) of 1 GiB; bandwidth = 2 x bytes / time): every weight once (bf16 Linear weights,
fp32 norms and scalars; B rows of the embedding), every cached key and value once, and every memory
and conv state read and written. Prefill: one prompt of each length through the trunk with the fused
kernels (chunks of --prefill-chunk tokens), tokens / s. Decode modes: "compiled graph" (torch.compile
and a CUDA graph, what `generate --compile` runs), "graph" (the eager step captured), "eager".
Results: benchmarks/results/decode_model-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.eval.common import parse_sizes, size_label  # noqa: E402
from atma_titan.inference import Generator, cast_for_inference  # noqa: E402
from atma_titan.models import FLAVORS, build_model  # noqa: E402
from benchmarks.common import result_path, write_json  # noqa: E402


def copy_bandwidth(gib: float = 1.0) -> float:
    """Device-to-device copy bandwidth in bytes / s (read + write)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def random_model(flavor: str):
    args = FLAVORS[flavor]
    model = build_model(args, torch.device("cuda"), seed=None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(std=0.1)
    return cast_for_inference(model.eval(), torch.bfloat16)


def step_bytes(model, batch: int, context: int) -> dict[str, int]:
    """What one decode step must read or write at least."""
    a = model.args
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed."))
    weights += batch * a.d_model * model.embed.weight.element_size()
    n_global = len(a.global_layers)
    kv = 2 * batch * (context + 1) * n_global * a.n_kv_heads * a.head_dim * 2  # bf16 k and v
    memory = 2 * batch * n_global * a.n_heads * a.head_dim * a.head_dim * 4 if a.memory else 0  # fp32, in and out
    convs = 2 * batch * 2 * ((a.n_layers - n_global) * (a.conv_kernel - 1) * a.d_model)
    return {"weights": weights, "kv": kv, "states": memory + convs}


def fill_context(engine: Generator, batch: int, context: int) -> list[int]:
    """Admit `batch` sequences and make their pages look like `context` cached tokens (random K/V)."""
    slots = [engine.cache.admit(context + 1).slot for _ in range(batch)]
    for pages in (*engine.cache.k_pages.values(), *engine.cache.v_pages.values()):
        pages.normal_()
    return slots


def time_decode(engine: Generator, slots: list[int], context: int, steps: int, runs: int, sample: bool) -> float:
    """Median seconds per decode step (the same position re-fed: the same work every step).

    sample: also take the greedy tokens to the host after every step, as the generation loop does
    (which waits for the step, so the host's work no longer overlaps the GPU's).
    """
    tokens, positions = [1] * len(slots), [context] * len(slots)
    for _ in range(3):
        engine.decode(tokens, positions, slots)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        for _ in range(steps):
            logits = engine.decode(tokens, positions, slots)
            if sample:
                logits.argmax(-1).tolist()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) / steps)
    return statistics.median(times)


MODES = {"compiled graph": (True, True), "graph": (True, False), "eager": (False, False)}  # (graphs, compile)


def bench_decode(model, batch: int, context: int, mode: str, args, bandwidth: float) -> dict:
    graphs, compile = MODES[mode]
    engine = Generator(
        model, max_batch=batch, max_context=context + 1, page_size=args.page_size, cuda_graphs=graphs, compile=compile
    )
    slots = fill_context(engine, batch, context)
    seconds = time_decode(engine, slots, context, args.steps, args.runs, sample=False)
    with_sampling = time_decode(engine, slots, context, args.steps, args.runs, sample=True)
    moved = step_bytes(model, batch, context)
    floor = sum(moved.values()) / bandwidth
    row = {
        "batch": batch, "context": context, "mode": mode, "cuda_graphs": graphs, "compiled": compile,
        "step_ms": seconds * 1e3,
        "tokens_per_s": batch / seconds, "loop_ms": with_sampling * 1e3, "loop_tokens_per_s": batch / with_sampling,
        "floor_ms": floor * 1e3, "over_floor": seconds / floor,
        "bytes": moved,
    }  # fmt: skip
    del engine
    torch.cuda.empty_cache()
    return row


def bench_prefill(model, length: int, args) -> dict:
    engine = Generator(
        model, max_batch=1, max_context=length, page_size=args.page_size, prefill_chunk=args.prefill_chunk
    )
    tokens = torch.randint(0, model.args.vocab_size, (length,)).tolist()
    times = []
    for _ in range(args.prefill_runs + 1):  # the first run compiles and tunes the kernels
        slot = engine.cache.admit(length)
        torch.cuda.synchronize()
        began = time.perf_counter()
        engine.prefill(tokens, slot.slot)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        engine.cache.release(slot)
    seconds = statistics.median(times[1:])
    del engine
    torch.cuda.empty_cache()
    return {"length": length, "seconds": seconds, "tokens_per_s": length / seconds, "runs": args.prefill_runs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="atma_370m")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--contexts", default="2K,32K")
    p.add_argument("--prefill", default="2K,32K", help="prompt lengths for prefill speed ('' = none)")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--prefill-runs", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="decode steps per timing")
    p.add_argument("--runs", type=int, default=5, help="timings per median")
    p.add_argument("--modes", default=",".join(MODES), help=f"decode modes to time, of: {', '.join(MODES)}")
    p.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    args = p.parse_args(argv)

    torch.backends.cuda.matmul.allow_tf32 = True
    bandwidth = copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.flavor}, runs per median {args.runs}", flush=True)
    model = random_model(args.flavor)
    results = {"gpu": gpu, "flavor": args.flavor, "copy_bandwidth": bandwidth, "decode": [], "prefill": []}
    results["settings"] = vars(args)
    for context in parse_sizes(args.contexts, "--contexts"):
        for batch in parse_sizes(args.batches, "--batches"):
            for mode in args.modes.split(","):
                row = bench_decode(model, batch, context, mode, args, bandwidth)
                results["decode"].append(row)
                print(
                    f"decode B {batch:>3} x {size_label(context):>4} {mode:>14}: "
                    f"{row['step_ms']:.3f} ms/step, {row['tokens_per_s']:,.0f} tok/s, floor {row['floor_ms']:.3f} ms "
                    f"({row['over_floor']:.2f}x); with greedy sampling {row['loop_tokens_per_s']:,.0f} tok/s",
                    flush=True,
                )
    for length in parse_sizes(args.prefill, "--prefill") if args.prefill else []:
        row = bench_prefill(model, length, args)
        results["prefill"].append(row)
        print(f"prefill {size_label(length):>4}: {row['seconds']:.3f} s, {row['tokens_per_s']:,.0f} tok/s", flush=True)
    write_json(result_path("decode_model", args.out), results)


if __name__ == "__main__":
    main()
