"""Training throughput of one configuration under several AC / compile settings, in one run.

    python benchmarks/train/train_speed.py --config train_configs/atma_370m.toml --steps 12 \
        --variants eager,compile,compile+selective,compile+full [--nproc 1] [-- extra overrides]
    python benchmarks/train/train_speed.py --variants compile+reference,compile+triton   # the kernels' effect
    python benchmarks/train/train_speed.py --variants compile+selective --baseline softmax   # vs a transformer
    python benchmarks/train/train_speed.py --baseline softmax --variants \
        compile+selective,compile+selective+acall,compile+noac,compile+selective+step32k,compile+selective+l4,compile+full+l4

Each variant is a real `torchrun -m atma_titan.train` run (FSDP2 under torchrun, even on one GPU);
tokens/s and MFU are medians over the steps after `--warmup`, and each variant is also reported as
a ratio to the first one. A variant with a smaller optimizer batch than the config's (step32k) runs
`--steps` and `--warmup` times as many steps, so that every variant is timed over the same tokens: 7
steps of one 32K micro-batch are one second of training, and its dips, 4-7% slower steps that recur
about every 6 steps, move a median of 7. With `--baseline softmax` the same trainer
first trains a same-size softmax transformer (BASELINES: softmax attention in every block, RoPE, no
Canon, no memory; the same widths, MLP, optimizer, batch and data) under `--baseline-variant`, and
every row gets its ratio to it.
Results go to benchmarks/results/train_speed-<gpu>-<date>.json (or train_speed-<tag>.json), each run's log
to outputs/train_speed/<time>/.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.common

from benchmarks.common import result_path, write_json  # noqa: E402

# A variant is a '+'-joined list of these switches, e.g. "compile+selective+triton".
SWITCHES = {
    "eager": ["--training.compile", "false"],
    "compile": ["--training.compile", "true"],
    "noac": ["--activation_checkpoint.mode", "none"],  # the recipe config itself sets selective
    "selective": ["--activation_checkpoint.mode", "selective"],
    "full": ["--activation_checkpoint.mode", "full"],
    # AC in every block, in the global (attention + memory) blocks only (the recipe config's), or in the
    # local (convolution) blocks only.
    "acall": ["--activation_checkpoint.blocks", "all"],
    "acglobal": ["--activation_checkpoint.blocks", "global"],
    "aclocal": ["--activation_checkpoint.blocks", "local"],
    "triton": ["--model.attention_impl", "triton", "--model.memory_impl", "triton"],
    "reference": ["--model.attention_impl", "reference", "--model.memory_impl", "reference"],
    "fla": ["--model.memory_impl", "fla"],
    # One micro-batch per optimizer step on one GPU: the recipe's micro-batch of 16 x 2048 tokens.
    "step32k": ["--training.batch_tokens", "32768"],
    # An L4's budget on a larger GPU: train_configs/atma_370m_l4.toml's micro-batch under a 22 GiB cap.
    "l4": ["--training.micro_batch_size", "8", "--debug.memory_cap_gib", "22"],
    # FSDP re-gathers every block in backward (the setting's default on several ranks; unset, one rank keeps them).
    "reshard": ["--parallelism.reshard_after_forward", "true"],
    # AdamW for every parameter (a fused kernel), no Muon: the softmax transformer trained so.
    "adamw": ["--optimizer.name", "adamw"],
    # Documents kept apart: every mixer stops at each EOT (data.document_mask).
    "docmask": ["--data.document_mask", "true"],
}


# A baseline is a model the variants are compared with, trained by the same trainer in the same run.
BASELINES = {
    "softmax": [
        "--model.attention", "softmax", "--model.global_layers", "all", "--model.memory", "false",
        "--model.position", "rope", "--model.canon", "false",
    ],
}  # fmt: skip


def variant_args(name: str) -> list[str]:
    unknown = [s for s in name.split("+") if s not in SWITCHES]
    if unknown:
        raise SystemExit(f"variant {name!r}: unknown switch {unknown}; allowed: {', '.join(SWITCHES)}")
    return [arg for switch in name.split("+") for arg in SWITCHES[switch]]


def steps_per_config_step(name: str, config: str, extra: list[str]) -> int:
    """How many of the variant's optimizer steps train the tokens of one step of the config's batch: 1, or
    more where the variant sets a smaller batch."""
    from atma_titan.config import load_config

    base = ["--config", config, *extra]
    batch = load_config(base).training.batch_tokens
    return max(1, batch // load_config(base + variant_args(name)).training.batch_tokens)


def run_variant(name: str, args, extra: list[str], folder: Path, baseline: str | None = None) -> dict:
    scale = steps_per_config_step(name, args.config, extra)
    steps, warmup = args.steps * scale, args.warmup * scale
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
        str(steps),
        "--metrics.log_freq",
        "1",
        "--job.print_config",
        "false",
        "--job.dump_folder",
        str(folder),
        *variant_args(name),
        *extra,
        *(BASELINES[baseline] if baseline else []),
    ]
    label = f"{baseline}:{name}" if baseline else name
    # The run's output goes to a log of its own, so a failed or timed-out variant can be read
    log_path = Path(args.logs) / f"{label.replace('+', '_').replace(':', '-')}.log"
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
        return {"variant": label, "error": f"{why}; log {log_path}:\n{tail}", "wall_s": wall}
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > warmup]
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "variant": label,
        "steps": steps,
        "timed_steps": len(timed),
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in timed),
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_memory_gib": max(r["memory_gib"] for r in rows),
        "final_loss": rows[-1]["loss"],
        "wall_s": wall,
    }


def print_table(results: list[dict]) -> None:
    """One row per run, each with its ratio to the first (the baseline when there is one)."""
    base = results[0].get("tokens_per_second")
    width = max(20, *(len(r["variant"]) + 1 for r in results))
    versus = "vs " + results[0]["variant"]
    print(f"\n{'variant':<{width}} {'tokens/s':>12} {versus:>{width}} {'MFU':>7} {'peak GiB':>9}")
    for r in results:
        if "error" in r:
            first, *rest = r["error"].strip().splitlines()
            print(f"{r['variant']:<{width}} failed: {first}" + (f" ... {rest[-1]}" if rest else ""))
            continue
        ratio = r["tokens_per_second"] / base if base else float("nan")
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(
            f"{r['variant']:<{width}} {r['tokens_per_second']:>12,.0f} {ratio:>{width - 1}.2f}x {mfu:>7} "
            f"{r['peak_memory_gib']:>9.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/atma_370m.toml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians (compilation)")
    parser.add_argument("--variants", default="eager,compile,compile+selective,compile+full")
    parser.add_argument("--baseline", choices=sorted(BASELINES), help="also train this model; ratios are to it")
    parser.add_argument("--baseline-variant", default="compile", help="the switches the baseline trains with")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--tag", help="name the file train_speed-<tag>.json instead")
    parser.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    parser.add_argument("--logs", default=f"outputs/train_speed/{time.strftime('%Y%m%d-%H%M%S')}", help="runs' logs")
    args, extra = parser.parse_known_args()
    for name in [*args.variants.split(","), args.baseline_variant]:
        variant_args(name)  # fail before the first run
    extra = [x for x in extra if x != "--"]
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    runs = [(name, None) for name in args.variants.split(",")]
    if args.baseline:
        runs.insert(0, (args.baseline_variant, args.baseline))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, baseline) in enumerate(runs):
            result = run_variant(name, args, extra, Path(tmp) / str(i), baseline)
            results.append(result)
            print(json.dumps(result), flush=True)
    print_table(results)
    result = {"config": args.config, "extra": extra, "nproc": args.nproc, "baseline": args.baseline, "results": results}
    write_json(result_path("train_speed", args.out, tag=args.tag), result)


if __name__ == "__main__":
    main()
