"""Submitting the cells as a SLURM job array: one `sweep run --cell N` per task (launch/sweep_array.sbatch)."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
from pathlib import Path

from atma_titan.sweep.plan import Plan, SweepError

# atma_titan/sweep/slurm.py -> the repository's launch/ folder
SBATCH_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "sweep_array.sbatch"


def forwarded_args(args: argparse.Namespace) -> list[str]:
    """The arguments each array task passes to `sweep run --cell N`: the plan and runtime options,
    as the user gave them (the tasks start in the submission directory)."""
    argv = ["--out", args.out]
    if args.base is not None:
        argv += ["--base", args.base]
        argv += [f"--factor={f}" for f in args.factor]
        argv += [f"--set={s}" for s in args.set]
        if args.seeds is not None:
            argv.append(f"--seeds={args.seeds}")
        if args.eval_args:
            argv.append(f"--eval-args={args.eval_args}")
        if args.skip_invalid:
            argv.append("--skip-invalid")
    if args.no_eval:
        argv.append("--no-eval")
    if args.launcher:
        argv.append(f"--launcher={args.launcher}")
    return argv


def sbatch_command(args: argparse.Namespace, n_cells: int) -> list[str]:
    """One array task per run (with --seeds: every (cell, seed)); task N runs `run --cell N`."""
    array = f"0-{n_cells - 1}" + (f"%{args.max_parallel}" if args.max_parallel else "")
    script = os.path.relpath(SBATCH_SCRIPT) if SBATCH_SCRIPT.is_relative_to(Path.cwd()) else str(SBATCH_SCRIPT)
    return ["sbatch", f"--array={array}", *shlex.split(args.sbatch_args or ""), script, *forwarded_args(args)]


def submit(args: argparse.Namespace, plan: Plan) -> int:
    """sbatch the plan's cells (or, with --dry-run, print the command); returns sbatch's exit status."""
    cmd = sbatch_command(args, len(plan.cells))
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    Path("logs").mkdir(exist_ok=True)  # SLURM opens logs/%x-%A_%a.out before the script runs
    print(f"submitting {plan.describe_runs()} as {len(plan.cells)} array tasks: {shlex.join(cmd)}", flush=True)
    try:
        return subprocess.run(cmd).returncode
    except FileNotFoundError:
        raise SweepError("sbatch not found: run this on a SLURM login node (or use --dry-run).") from None
