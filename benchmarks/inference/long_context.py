"""Long-context forward of a whole model on one GPU: time and peak memory per kernel choice.

    python benchmarks/inference/long_context.py --flavor atma_370m --lengths 8K,32K,64K --impls triton,reference

Random weights (the cost of a forward does not depend on their values) in bf16, one sequence, no
gradients; the LM head runs on the last position only, as the evaluation does. Each (impl, length)
is timed after a warm-up call; the reference is skipped at lengths where it would take too long
(`--max-reference`). Results go to benchmarks/results/long_context-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.models import ATMA  # noqa: E402
from atma_titan.models.flavors import FLAVORS  # noqa: E402
from benchmarks.common import device_name, result_path, write_json  # noqa: E402


def parse_length(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


def build(flavor: str, impl: str, device: torch.device) -> ATMA:
    args = dataclasses.replace(FLAVORS[flavor], attention_impl=impl, memory_impl=impl)
    with torch.device(device):
        model = ATMA(args)
    model.init_weights()
    return model.to(torch.bfloat16).eval()


@torch.no_grad()
def forward_last(model: ATMA, tokens: torch.Tensor) -> torch.Tensor:
    h, _ = model.trunk(tokens)
    return model.head(h[:, -1:])


def measure(model: ATMA, length: int, device: torch.device) -> dict:
    tokens = torch.randint(0, model.args.vocab_size, (1, length), device=device)
    forward_last(model, tokens)  # warm-up: autotuning and allocator growth are not timed
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    logits = forward_last(model, tokens)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "tokens_per_second": length / seconds,
        "peak_gib_above_weights": (torch.cuda.max_memory_allocated() - base) / 2**30,
        "finite": bool(torch.isfinite(logits).all()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="atma_370m", choices=sorted(FLAVORS))
    parser.add_argument("--lengths", default="8K,32K,64K")
    parser.add_argument("--impls", default="triton,reference")
    parser.add_argument("--max-reference", default="64K", help="longest length the reference is run at")
    parser.add_argument("--tag", help="name the file long_context-<tag>.json instead")
    parser.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/inference/long_context.py measures a GPU; no CUDA device is visible")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    max_reference = parse_length(args.max_reference)

    results = []
    for impl in args.impls.split(","):
        model = build(args.flavor, impl, device)
        for length in lengths:
            if impl == "reference" and length > max_reference:
                continue
            try:
                row = {"impl": impl, "length": length, **measure(model, length, device)}
            except torch.OutOfMemoryError as err:
                row = {"impl": impl, "length": length, "error": f"out of memory: {str(err).splitlines()[0]}"}
            results.append(row)
            print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()

    print(f"\n{'impl':<10} {'length':>8} {'seconds':>9} {'tokens/s':>11} {'peak GiB':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['impl']:<10} {r['length']:>8} {r['error']}")
            continue
        print(
            f"{r['impl']:<10} {r['length']:>8} {r['seconds']:>9.3f} {r['tokens_per_second']:>11,.0f}"
            f" {r['peak_gib_above_weights']:>9.2f}"
        )
    result = {"flavor": args.flavor, "device": device_name(), "results": results}
    write_json(result_path("long_context", args.out, tag=args.tag), result)


if __name__ == "__main__":
    main()
