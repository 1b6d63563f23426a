"""The command line: `python -m atma_titan.sweep {run,list,collect,slurm,plan} ...` (run is the default)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from atma_titan.utils.cli import HelpFormatter, command, command_parser
from atma_titan.sweep.budget import budget_report, estimate, plan_cells, read_throughput
from atma_titan.sweep.collect import collect, list_cells
from atma_titan.sweep.local import run_sweep
from atma_titan.sweep.plan import (
    PLAN_FILE,
    Plan,
    SweepError,
    build_plan,
    check_plan,
    parse_plan_options,
    read_plan,
    save_plan,
)
from atma_titan.sweep.slurm import submit

COMMANDS = {
    "run": "train and evaluate every cell (or one with --cell) here, one after another, then collect",
    "list": "print the cells with index, name, loss and status (done/trained/pending/failed)",
    "collect": "write results.md, results.csv, needle.png and length_curve.png from the finished cells",
    "slurm": "submit the cells as a SLURM job array (launch/sweep_array.sbatch)",
    "plan": "print the estimated GPU-hours of training per cell and in total on H100 / H200 / L4 (runs nothing)",
}
# Options whose values are command lines themselves ("--gaps 2048", "--time=1:00:00"): argparse
# would take a value that starts with '-' for an option, so they are joined as --opt=value first.
COMMAND_LINE_OPTIONS = ("--eval-args", "--launcher", "--sbatch-args")


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """The options every command shares: the sweep folder and the plan."""
    p.add_argument("--out", required=True, help="the sweep folder (sweep.json, cells/)")
    p.add_argument("--base", help="base TOML config of every cell (omit to use the plan in sweep.json)")
    p.add_argument(
        "--factor",
        action="append",
        default=[],
        metavar="SECTION.KEY=V1,V2",
        help="a factor of the sweep: section.key=v1,v2,... or section.key=[v1,v2] (repeat for more factors)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a fixed override for every cell"
    )
    p.add_argument(
        "--seeds",
        metavar="S1,S2",
        help="train every cell once per job.seed, e.g. 0,1,2 (runs <cell>_seed-<S>; collect gives mean and range)",
    )
    p.add_argument(
        "--eval-args",
        help='extra arguments of the eval command, e.g. "--gaps 2048,4096 --records" (the sweep adds --trials 256 '
        "unless they set --trials)",
    )
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="leave out factor combinations the config rejects, instead of refusing the plan",
    )
    p.add_argument("--force-plan", action="store_true", help="replace a different plan in sweep.json")


def add_command_options(name: str, p: argparse.ArgumentParser) -> None:
    if name in ("run", "slurm"):
        p.add_argument("--no-eval", action="store_true", help="train only; a cell counts as finished once trained")
        p.add_argument(
            "--launcher", help='training launcher instead of plain python, e.g. "torchrun --nproc_per_node=8"'
        )
    if name == "run":
        p.add_argument("--cell", type=int, metavar="INDEX", help="run only this cell (what an array task runs)")
        p.add_argument(
            "--jobs",
            type=int,
            default=1,
            help="cells run at once on this machine, sharing its GPU (small models: one cell leaves it idle)",
        )
    if name == "slurm":
        p.add_argument("--max-parallel", type=int, default=0, help="at most N array tasks at once (0: no limit)")
        p.add_argument("--sbatch-args", help='extra sbatch options, e.g. "--time=04:00:00 -p gpu"')
        p.add_argument("--dry-run", action="store_true", help="print the sbatch command instead of running it")
    if name == "plan":
        p.add_argument(
            "--throughput",
            metavar="FILE.json",
            help="tokens/s per GPU kind to estimate from (default: the built-in table, measured on the H200; "
            "its shape: atma_titan/sweep/budget.py)",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "sweep",
        "Ablation sweeps: a factorial over config keys, each cell trained and evaluated.",
        epilog="The command defaults to run. Run `python -m atma_titan.sweep COMMAND -h` for its options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        add_plan_options(p)
        add_command_options(name, p)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = ["run", *argv]
    joined, i = [], 0
    while i < len(argv):
        if argv[i] in COMMAND_LINE_OPTIONS and i + 1 < len(argv):
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    return build_parser().parse_args(joined)


def resolve_plan(args: argparse.Namespace, *, write: bool) -> Plan:
    """The plan from the command line (checked against sweep.json), else the one in sweep.json."""
    out = Path(args.out)
    if args.base is None:
        if args.factor or args.set or args.eval_args is not None or args.skip_invalid or args.seeds is not None:
            raise SweepError(
                "--factor, --set, --seeds, --eval-args and --skip-invalid need --base (or give only --out to use "
                "sweep.json)."
            )
        saved = read_plan(out)
        if saved is None:
            raise SweepError(f"no {PLAN_FILE} in {out}: give the plan (--base FILE --factor ...).")
        if not write:
            return saved  # list / collect: read-only, and no torch import
        plan = build_plan(saved)  # re-validated, and the base file checked for changes below
    else:
        options = parse_plan_options(
            args.base, args.factor, args.set, args.eval_args or "", args.skip_invalid, args.seeds
        )
        plan = build_plan(options)
    return save_plan(out, plan, args.force_plan) if write else check_plan(out, plan, args.force_plan)


# ---------------------------------------------------------------------------------------------
# The commands: each returns the exit status


def run_command(args: argparse.Namespace) -> int:
    if args.jobs < 1:  # before the plan is written
        raise SweepError(f"--jobs {args.jobs}: run at least one cell at a time (allowed: 1 or more)")
    plan = resolve_plan(args, write=True)
    if plan.skipped:
        names = ", ".join(s["name"] for s in plan.skipped)
        print(f"left out {len(plan.skipped)} invalid combination(s) (--skip-invalid): {names}", flush=True)
    return run_sweep(
        plan, Path(args.out), cell_index=args.cell, evaluate=not args.no_eval, launcher=args.launcher, jobs=args.jobs
    )


def list_command(args: argparse.Namespace) -> int:
    plan = resolve_plan(args, write=False)
    print(f"sweep {args.out}: {plan.describe_runs()}, base {plan.base}")
    print(list_cells(plan, Path(args.out)))
    for skipped in plan.skipped:
        print(f"left out (--skip-invalid): {skipped['name']}: {skipped['reason']}")
    return 0


def collect_command(args: argparse.Namespace) -> int:
    collect(resolve_plan(args, write=False), Path(args.out))
    return 0


def slurm_command(args: argparse.Namespace) -> int:
    return submit(args, resolve_plan(args, write=not args.dry_run))  # a dry run writes nothing


def plan_command(args: argparse.Namespace) -> int:
    """The GPU-hour estimate; writes nothing (a saved plan is only read, a new one only checked)."""
    plan = resolve_plan(args, write=False)
    table = read_throughput(args.throughput)
    print(budget_report(plan, args.out, estimate(plan_cells(plan), table), table))
    return 0


RUNNERS = {
    "run": run_command,
    "list": list_command,
    "collect": collect_command,
    "slurm": slurm_command,
    "plan": plan_command,
}


@command
def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 all requested cells finished, 1 some cell failed, 2 a bad plan or option (SweepError, and
    the loader's and eval report's bad-input errors)."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    return RUNNERS[args.command](args)
