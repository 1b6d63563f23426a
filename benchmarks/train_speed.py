"""Training throughput of one configuration under several AC / compile settings, in one run.

    python benchmarks/train_speed.py --config train_configs/atma_370m.toml --steps 12 \
        --variants eager,compile,compile+selective,compile+full [--nproc 1] [-- extra overrides]
    python benchmarks/train_speed.py --variants compile+reference,compile+triton   # the kernels' effect

Each variant is a real `torchrun -m atma_titan.train` run (FSDP2 under torchrun, even on one GPU);
tokens/s and MFU are medians over the steps after `--warmup`, and each variant is also reported as
a ratio to the first one. Results go to benchmarks/results/train_speed-<tag>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A variant is a '+'-joined list of these switches, e.g. "compile+selective+triton".
SWITCHES = {
    "eager": [],
    "compile": ["--training.compile", "true"],
    "selective": ["--activation_checkpoint.mode", "selective"],
    "full": ["--activation_checkpoint.mode", "full"],
    "triton": ["--model.attention_impl", "triton", "--model.memory_impl", "triton"],
    "reference": ["--model.attention_impl", "reference", "--model.memory_impl", "reference"],
    "fla": ["--model.memory_impl", "fla"],
}


def variant_args(name: str) -> list[str]:
    unknown = [s for s in name.split("+") if s not in SWITCHES]
    if unknown:
        raise SystemExit(f"variant {name!r}: unknown switch {unknown}; allowed: {', '.join(SWITCHES)}")
    return [arg for switch in name.split("+") for arg in SWITCHES[switch]]


def run_variant(name: str, args, extra: list[str], folder: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "-m",
        "atma_titan.train",
        "--config",
        args.config,
        "--training.steps",
        str(args.steps),
        "--metrics.log_freq",
        "1",
        "--job.print_config",
        "false",
        "--job.dump_folder",
        str(folder),
        *variant_args(name),
        *extra,
    ]
    # The run's output goes to a log beside the results, so a failed or timed-out variant can be read
    log_path = Path(args.out) / f"train_speed-{args.tag}-{name.replace('+', '_')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc = None
    wall = time.time() - start
    if proc is None or proc.returncode != 0:
        why = f"timed out after {args.timeout} s" if proc is None else f"exit code {proc.returncode}"
        tail = log_path.read_text()[-2000:]
        return {"variant": name, "error": f"{why}; log {log_path}:\n{tail}", "wall_s": wall}
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > args.warmup]
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "variant": name,
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in timed),
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_memory_gib": max(r["memory_gib"] for r in rows),
        "final_loss": rows[-1]["loss"],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/atma_370m.toml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians (compilation)")
    parser.add_argument("--variants", default="eager,compile,compile+selective,compile+full")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--tag", default=time.strftime("%Y%m%d-%H%M%S"))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args, extra = parser.parse_known_args()
    for name in args.variants.split(","):
        variant_args(name)  # fail before the first run
    extra = [x for x in extra if x != "--"]
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants.split(","):
            result = run_variant(name, args, extra, Path(tmp) / name)
            results.append(result)
            print(json.dumps(result), flush=True)
    base = results[0].get("tokens_per_second")
    print(f"\n{'variant':<20} {'tokens/s':>12} {'vs ' + results[0]['variant']:>14} {'MFU':>7} {'peak GiB':>9}")
    for r in results:
        if "error" in r:
            first, *rest = r["error"].strip().splitlines()
            print(f"{r['variant']:<20} failed: {first}" + (f" ... {rest[-1]}" if rest else ""))
            continue
        ratio = r["tokens_per_second"] / base if base else float("nan")
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(
            f"{r['variant']:<20} {r['tokens_per_second']:>12,.0f} {ratio:>13.2f}x {mfu:>7} {r['peak_memory_gib']:>9.1f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"train_speed-{args.tag}.json"
    path.write_text(
        json.dumps({"config": args.config, "extra": extra, "nproc": args.nproc, "results": results}, indent=2)
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
