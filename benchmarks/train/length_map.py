"""Where does length invariance hold? The sweeps behind docs/results.md's length map, and its report.

    python benchmarks/train/length_map.py commands [--out sweeps/map] [--questions 1,2,3,4,5] [--jobs 12]
        [--sweeps time-370m,global-370m] [--seeds 1]
    python benchmarks/train/length_map.py report --out sweeps/map --results REPORT_FOLDER

`commands` prints the shell lines that train and evaluate every run, one line per sweep (its
`atma_titan.sweep` command, then, where asked, the evaluation of every checkpoint of its runs); the lines are
independent and may run at once; `report` reads the finished sweeps and writes
length_map.md (one table per question: means over the training seeds with their range), length_map.json
(every run's numbers), recall_vs_train_length.png and recall_over_training.png.

Every sweep starts from the toy cell, train_configs/repro/polar_memory.toml (4.4M parameters, 4 blocks
with one global, 1,500 steps of 8,192 tokens of the synthetic records at 128 tokens, AdamW 1e-3) and
changes one thing; recall is the records needle, exact 5/5, at 1x, 8x and 32x the training length:

1. training length: 128, 512 and 2,048 tokens (the same 8,192 tokens per step and steps), Polar and
   softmax attention (both with the memory);
2. depth and global blocks: 4 blocks all global, 16 blocks with one global (block 14) or four (2, 6, 10,
   14), and the toy's depth at the 370M's width (d 1,024, 8 heads of 128, MLP 4,096) with the matrix
   learning rate scaled by 256 / 1,024 (muP's rule for Adam on hidden matrices);
3. training time: recall at 1x and 32x at every tenth of the run for the toy at 128 and at 2,048 (the
   runs of question 1), and at 2,048 with a lower peak learning rate (3e-4), a shorter run (500 steps)
   or Polar's unit direction; and at 1x, 4x and 32x at every fifth of the run for the 370M body
   (train_configs/repro/atma_370m_polar_memory.toml, 4.5 GB a checkpoint, 2 seeds), its last checkpoint
   evaluated as the toy cells at 1x, 8x and 32x (2K, 16K, 64K);
4. the 370M body changed along what 1-3 point to: one global block of its 16 (block 14) instead of four,
   2 seeds, evaluated as the 370M body of 3, beside which the report sets it;
5. documents apart: Polar and softmax, with and without data.document_mask, at 128.

`report --previous` adds the runs of earlier reports' length_map.json that --out does not hold again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from atma_titan.eval.common import parse_sizes, size_label  # noqa: E402
from atma_titan.eval.report import RESULTS_JSON, markdown_table  # noqa: E402
from atma_titan.sweep.cells import CELLS_FOLDER, CellFolder  # noqa: E402
from atma_titan.sweep.plan import SweepError, parse_seeds  # noqa: E402
from atma_titan.sweep.seeds import Spread  # noqa: E402

TOY = "train_configs/repro/polar_memory.toml"
BODY_370M = "train_configs/repro/atma_370m_polar_memory.toml"
TOY_BATCH = 8192  # tokens per step of every toy run
TENTH = 150  # checkpoint interval: a tenth of the toy's 1,500 steps
SEEDS = "0,1,2"
MULTIPLES = (1, 8, 32)  # needle gaps, times the training length
DEPTHS = (0.0, 0.5)
TRIALS = 128  # per gap and depth: 256 per gap over the two depths
STEPS_EVAL = "--records --depths 0 --trials 32 --no-control"  # recall over training: 1x and 32x, cheaper


@dataclass(frozen=True)
class Sweep:
    name: str  # its folder under --out
    question: int
    factors: tuple[str, ...]
    sets: tuple[str, ...] = ()
    seq_len: int = 128
    over_training: str | None = None  # the runs (a cell-name prefix) whose every checkpoint is evaluated
    final_eval: bool = True  # the full needle after training; else only recall over training
    every: int = TENTH  # checkpoint interval where recall over training is read (a tenth of the toy's run)
    base: str = TOY
    steps_multiples: tuple[int, ...] = (1, 32)  # the gaps of recall over training, times the training length
    seeds: str = SEEDS

    def fixed(self) -> list[str]:
        # A checkpoint at every tenth only where recall over training reads them; else the last alone (the
        # 1,024-wide cells' ten checkpoints are 40 GB a sweep).
        interval = self.every if self.over_training or not self.final_eval else 10 * self.every
        common = ["eval.interval=0", f"checkpoint.interval={interval}", "checkpoint.keep_latest_k=0", *self.sets]
        if self.base != TOY:  # the config's own length and batch
            return common
        n = self.seq_len
        return [f"training.seq_len={n}", f"training.micro_batch_size={TOY_BATCH // n}", *common]

    def eval_args(self) -> str:
        if not self.final_eval:
            return self.steps_eval_args()
        n = self.seq_len
        gaps = ",".join(str(m * n) for m in MULTIPLES)
        return f"--records --gaps {gaps} --depths 0,0.5 --trials {TRIALS} --no-control --generate-gaps {32 * n}" + (
            " --length-curve --lengths 128,1K,4K --documents 16" if self.question == 5 else ""
        )

    def steps_eval_args(self) -> str:
        gaps = ",".join(str(m * self.seq_len) for m in self.steps_multiples)
        return f"--steps all --gaps {gaps} {STEPS_EVAL}"


WIDE = ("model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=128", "model.mlp_hidden=4096")
LOW_LR = ("optimizer.embed_lr=0.0003", "optimizer.head_lr=0.0003", "optimizer.scalar_lr=0.0003")
# The 370M body at its own length and batch, two seeds, read over training at 1x, 4x and 32x at every fifth of
# its 763 steps (153; ten checkpoints would be 45 GB a run).
BODY_370M_FIFTHS = dict(seq_len=2048, every=153, base=BODY_370M, steps_multiples=(1, 4, 32), seeds="0,1")
SWEEPS = (
    Sweep("length-128", 1, ("model.attention=polar,softmax",), over_training="attention-polar"),
    Sweep("length-512", 1, ("model.attention=polar,softmax",), seq_len=512),
    Sweep("length-2048", 1, ("model.attention=polar,softmax",), seq_len=2048, over_training="attention-polar"),
    Sweep("depth-4", 2, ("model.global_layers=all",)),
    Sweep("depth-16", 2, ('model.global_layers="14","i%4==2"',), sets=("model.n_layers=16",)),
    Sweep("width-1024", 2, ("optimizer.matrix_lr=0.00025",), sets=WIDE),
    Sweep("time-2048-lr", 3, ("optimizer.matrix_lr=0.0003",), sets=LOW_LR, seq_len=2048, final_eval=False),
    Sweep("time-2048-short", 3, ("training.steps=500",), seq_len=2048, final_eval=False, every=50),
    Sweep("time-2048-unit", 3, ("model.polar_direction=unit",), seq_len=2048, final_eval=False),
    # the 370M bodies: every fifth over training, and the toy cells' full evaluation of the last checkpoint
    Sweep("time-370m", 3, ("model.attention=polar",), over_training="attention-polar", **BODY_370M_FIFTHS),
    Sweep("global-370m", 4, ('model.global_layers="14"',), over_training="global_layers-14", **BODY_370M_FIFTHS),
    Sweep("documents-128", 5, ("model.attention=polar,softmax", "data.document_mask=false,true")),
)


def sweep_command(sweep: Sweep, out: str, jobs: int, seeds: str) -> str:
    parts = ["python -m atma_titan.sweep run", f"--base {sweep.base}", f"--out {out}/{sweep.name}"]
    parts += [f"--factor {shlex.quote(f)}" for f in sweep.factors] + [f"--set {s}" for s in sweep.fixed()]
    parts += [f"--seeds {seeds}", f"--jobs {jobs}", f"--eval-args {shlex.quote(sweep.eval_args())}"]
    return " ".join(parts)


def steps_command(sweep: Sweep, out: str, seeds: str) -> str | None:
    """The evaluation of every checkpoint of the sweep's `over_training` runs of these seeds, into each run's
    eval_steps/ (the runs at once)."""
    if not sweep.over_training or not sweep.final_eval:
        return None
    cells = " ".join(f"{out}/{sweep.name}/cells/{sweep.over_training}_seed-{s}" for s in seeds.split(","))
    return (
        f'for cell in {cells}; do python -m atma_titan.eval --checkpoint "$cell/run" {sweep.steps_eval_args()} '
        f'--out "$cell/eval_steps" & done; wait'
    )


def commands(
    out: str, questions: set[int], jobs: int, seeds: str | None = None, names: set[str] | None = None
) -> list[str]:
    """One line per sweep (of these questions, and of these names if given): the sweep, then (where asked) the
    evaluation of its runs over training. `seeds` replaces each sweep's own training seeds (to add a seed to a
    finished map: `report --previous` merges)."""
    lines = []
    for sweep in (s for s in SWEEPS if s.question in questions and (names is None or s.name in names)):
        these = seeds or sweep.seeds
        steps = steps_command(sweep, out, these)
        lines.append(sweep_command(sweep, out, jobs, these) + (f" && {steps}" if steps else ""))
    return lines


# ---------------------------------------------------------------------------------------------
# The report


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def recall(needle: list[dict], train_len: int) -> dict[str, float]:
    """'32x d0' / '32x d0.5 gen' -> exact recall in percent."""
    out = {}
    for row in needle:
        mode = " gen" if row.get("mode") == "generated" else ""
        out[f"{row['gap'] / train_len:g}x d{row['depth']:g}{mode}"] = 100 * row["exact_acc"]
    return out


def planned_cells(out: Path):
    """(sweep, cell, its folder) for every cell of every sweep planned under `out`."""
    for sweep in SWEEPS:
        plan = _read_json(out / sweep.name / "sweep.json")
        for cell in (plan or {}).get("cells", []):
            yield sweep, cell, CellFolder(out / sweep.name / CELLS_FOLDER / cell["name"])


def unfinished(out: Path) -> list[str]:
    """The cells whose run folder exists without run/DONE (training stopped, or the folder was copied
    without it): the report leaves them out and says so."""
    return [
        f"{sweep.name}/{cell['name']}"
        for sweep, cell, folder in planned_cells(out)
        if folder.run_dir.is_dir() and not folder.trained()
    ]


def load_runs(out: Path) -> list[dict]:
    """Every trained run of every sweep: its sweep, cell, seed, final training loss, and what was evaluated of it
    (recall, NLL curve, recall over training; empty where its evaluation has not run)."""
    runs = []
    for sweep, cell, folder in planned_cells(out):
        if not folder.trained():
            continue
        final = _read_json(folder.results) or {"needle": []}
        train_len = sweep.seq_len
        steps = _read_json(folder.path / "eval_steps" / RESULTS_JSON) or final
        last = folder.final_train_metrics()
        runs.append({
            "sweep": sweep.name, "question": sweep.question, "cell": cell["group"], "seed": cell["seed"],
            "train_len": train_len, "final_step": last["step"], "final_loss": last["loss"],
            "recall": recall(final["needle"], train_len) if sweep.final_eval else {},
            "nll": dict(zip(map(size_label, (final.get("length_curve") or {}).get("lengths", [])),
                            (final.get("length_curve") or {}).get("nll", []))),
            "over_training": [
                {"step": s["step"], "recall": recall(s["needle"], train_len)}
                for s in steps.get("over_training", [])
            ],
        })  # fmt: skip
    return runs


def with_previous(runs: list[dict], previous: list[Path]) -> list[dict]:
    """`runs` and, after them, the runs of earlier reports (newest first) whose sweep, cell and seed no later
    report or run holds: a sweep trained again replaces its earlier runs one by one."""
    seen = {(r["sweep"], r["cell"], r["seed"]) for r in runs}
    out = list(runs)
    for path in previous:
        for run in json.loads(path.read_text()):
            key = (run["sweep"], run["cell"], run["seed"])
            if key not in seen:
                seen.add(key)
                out.append(run)
    return out


def spread(values: list[float], digits: int = 1) -> str:
    """'80.0 (70.0-90.0)': the mean over seeds and their range; '-' for none."""
    found = Spread.of(values)
    return "-" if found is None else found.text(f"{{:.{digits}f}}", found.n)


def by_cell(runs) -> dict[tuple[str, str], list[dict]]:
    """The runs grouped by (sweep, cell), in order."""
    out: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        out.setdefault((run["sweep"], run["cell"]), []).append(run)
    return out


def groups(runs: list[dict], question: int) -> dict[tuple[str, str], list[dict]]:
    """The cells of a question; question 4's table sets the 370M body it changes beside it (question 3's)."""
    bodies = {s.name for s in SWEEPS if s.base == BODY_370M} if question == 4 else set()
    return by_cell(r for r in runs if r["question"] == question or r["sweep"] in bodies)


def table(header: list[str], rows: list[list[str]]) -> str:
    return markdown_table(header, rows) if rows else "No run of this question has been evaluated yet."


def recall_table(runs: list[dict], question: int, nll: bool = False) -> str:
    columns = [f"{m}x d{d:g}" for d in DEPTHS for m in MULTIPLES] + [f"32x d{d:g} gen" for d in DEPTHS]
    header = ["sweep", "cell", "n"] + [c.replace(" d0.5", " 50%").replace(" d0", " 0") for c in columns]
    measured = {k for r in runs if r["question"] == question for k in r["nll"]} if nll else set()
    nll_lengths = sorted(measured, key=lambda k: parse_sizes(k)[0])
    header += [f"NLL {k}" for k in nll_lengths]
    rows = []
    for (sweep, cell), all_members in groups(runs, question).items():
        members = [r for r in all_members if r["recall"]]
        if not members:
            continue
        row = [sweep, cell, str(len(members))]
        row += [spread([r["recall"][c] for r in members if c in r["recall"]]) for c in columns]
        row += [spread([r["nll"][k] for r in members if k in r["nll"]], 3) for k in nll_lengths]
        rows.append(row)
    return table(header, rows)


def over_training_table(runs: list[dict], multiple: int) -> str:
    """Exact recall (%) at `multiple` x, depth 0, at each tenth of the run (columns) per cell (rows)."""
    header, rows = ["sweep", "cell", "n"] + [f"{10 * i}%" for i in range(1, 11)], []
    for (sweep, cell), members in _over_training_groups(runs).items():
        steps = [s["step"] for s in members[0]["over_training"]]
        last = steps[-1]
        by_tenth: dict[int, list[float]] = {}
        for run in members:
            for s in run["over_training"]:
                value = s["recall"].get(f"{multiple}x d0")
                if value is not None:
                    by_tenth.setdefault(round(10 * s["step"] / last), []).append(value)
        if by_tenth:  # a cell not measured at this multiple has no row
            rows.append([sweep, cell, str(len(members))] + [spread(by_tenth.get(i, [])) for i in range(1, 11)])
    return table(header, sorted(rows))


def _over_training_groups(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The cells, of any question, whose runs were evaluated over training."""
    return by_cell(r for r in runs if r["over_training"])


def loss_table(runs: list[dict]) -> str:
    """Every trained cell's final training loss (recall tokens weighted x100, so a model that has not learned
    to recall sits near 40 and one that has near 2.7), mean over its seeds with the range."""
    rows = []
    for (sweep, cell), members in by_cell(sorted(runs, key=lambda r: r["question"])).items():
        steps = sorted({r["final_step"] for r in members})
        rows.append([sweep, cell, str(len(members)), "/".join(map(str, steps)),
                     spread([r["final_loss"] for r in members], 2)])  # fmt: skip
    return table(["sweep", "cell", "n", "steps", "final training loss"], rows)


def write_report(runs: list[dict], results: Path) -> list[Path]:
    results.mkdir(parents=True, exist_ok=True)
    sections = [
        "# The length map: exact recall (%) of the records needle, mean over seeds (range)",
        "Columns: gap as a multiple of the training length, needle depth (0: before the haystack, 50%: in "
        "its middle); `gen`: the value generated free-running, else teacher-forced.",
        "## Training: the final loss of every trained cell\n\n" + loss_table(runs),
        "## 1. Training length\n\n" + recall_table(runs, 1),
        "## 2. Depth, global blocks and width (at 128)\n\n" + recall_table(runs, 2),
        "## 3. Recall over training, depth 0: 32x\n\n" + over_training_table(runs, 32),
        "## 3. Recall over training, depth 0: 4x (the 370M bodies)\n\n" + over_training_table(runs, 4),
        "## 3. Recall over training, depth 0: 1x\n\n" + over_training_table(runs, 1),
        "## 4. The 370M body: four global blocks (question 3's) and one\n\n" + recall_table(runs, 4),
        "## 5. Documents apart (at 128)\n\n" + recall_table(runs, 5, nll=True),
    ]
    written = [results / "length_map.md", results / "length_map.json"]
    written[0].write_text("\n\n".join(sections) + "\n")
    written[1].write_text(json.dumps(runs, indent=1) + "\n")
    return written + plot(runs, results)


def plot(runs: list[dict], results: Path) -> list[Path]:
    """The two figures, each drawn only when some run has its numbers."""
    written = []
    if any(r["recall"] for r in runs if r["question"] == 1):
        written.append(plot_train_length(runs, results / "recall_vs_train_length.png"))
    if any(r["over_training"] for r in runs):
        written.append(plot_over_training(runs, results / "recall_over_training.png"))
    return written


def plot_train_length(runs: list[dict], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.6), layout="constrained")
    ax = fig.subplots()
    for i, attention in enumerate(("polar", "softmax")):
        for key, style in (("32x d0", "-"), ("32x d0 gen", "--")):
            points = []
            for (_, cell), members in groups(runs, 1).items():
                values = [r["recall"][key] for r in members if key in r["recall"]]
                if cell == f"attention-{attention}" and values:
                    points.append((members[0]["train_len"], statistics.fmean(values), min(values), max(values)))
            points.sort()
            if points:
                x, y, lo, hi = zip(*points)
                ax.errorbar(
                    x, y, yerr=[[a - b for a, b in zip(y, lo)], [b - a for a, b in zip(y, hi)]], color=f"C{i}",
                    linestyle=style, marker="o", capsize=3,
                    label=f"{attention} + memory, {'generated' if 'gen' in key else 'teacher-forced'}",
                )  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks([128, 512, 2048], ["128", "512", "2K"])
    ax.set_xlabel("training length (tokens); recall measured at 32x it")
    ax.set_ylabel("exact recall at 32x (% of trials), depth 0")
    ax.set_ylim(-3, 103)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("Recall at 32x the training length (mean over seeds, range as bars)")
    fig.savefig(path, dpi=120)
    return path


def plot_over_training(runs: list[dict], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.subplots()
    for i, ((sweep, cell), members) in enumerate(sorted(_over_training_groups(runs).items())):
        for key, style in (("32x d0", "-"), ("1x d0", ":")):
            steps = sorted({s["step"] for r in members for s in r["over_training"]})
            if not steps:
                continue
            means = [
                statistics.fmean(v) if (v := [s["recall"][key] for r in members for s in r["over_training"]
                                              if s["step"] == step and key in s["recall"]]) else None
                for step in steps
            ]  # fmt: skip
            label = f"{sweep} {cell} {key.split()[0]}"
            ax.plot(steps, means, color=f"C{i % 10}", linestyle=style, marker="o", markersize=3, label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel("exact recall (% of trials), depth 0")
    ax.set_ylim(-3, 103)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small", ncols=2)
    ax.set_title("Recall over training: 32x (solid) and 1x (dotted), mean over seeds")
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("commands", help="print the shell lines that train and evaluate every run")
    c.add_argument("--out", default="sweeps/map")
    c.add_argument("--questions", default="1,2,3,4,5", help="which questions' sweeps (1 to 5)")
    c.add_argument("--jobs", type=int, default=12, help="runs at once per sweep (the sweep's --jobs)")
    c.add_argument("--sweeps", help="only these sweeps, by name, e.g. time-370m,global-370m")
    c.add_argument("--seeds", help="only these training seeds, e.g. 1 (default: each sweep's own)")
    r = sub.add_parser("report", help="the tables and plots of the finished sweeps")
    r.add_argument("--out", default="sweeps/map")
    r.add_argument("--results", required=True, help="folder for length_map.md, length_map.json and the plots")
    r.add_argument(
        "--previous",
        nargs="*",
        default=[],
        metavar="JSON",
        help="earlier reports' length_map.json: their runs that --out does not hold again are kept",
    )
    args = p.parse_args(argv)
    if args.verb == "commands":
        try:
            questions = {int(q) for q in args.questions.split(",")}
        except ValueError:
            p.error(f"--questions {args.questions!r}: comma-separated question numbers, e.g. 1,3")
        known = {s.question for s in SWEEPS}
        if questions - known:
            choices = ", ".join(map(str, sorted(known)))
            p.error(f"--questions: no sweep answers question(s) {sorted(questions - known)}; choose from {choices}")
        try:  # the sweep's own reading of --seeds
            seeds = None if args.seeds is None else ",".join(map(str, parse_seeds(args.seeds)))
        except SweepError as err:
            p.error(str(err))
        names = set(args.sweeps.split(",")) if args.sweeps else None
        unknown = sorted((names or set()) - {s.name for s in SWEEPS})
        if unknown:
            p.error(f"--sweeps: no sweep named {', '.join(unknown)}; choose from {', '.join(s.name for s in SWEEPS)}")
        print("\n".join(commands(args.out, questions, args.jobs, seeds, names)))
        return 0
    previous = [Path(path) for path in args.previous]
    for path in previous:
        if not path.is_file():
            p.error(f"--previous {path}: no such file (an earlier report's length_map.json)")
    here = load_runs(Path(args.out))
    for name in unfinished(Path(args.out)):
        print(f"left out {name}: its run has no run/DONE (training stopped, or copied without it)", file=sys.stderr)
    runs = with_previous(here, previous)
    if not runs:
        p.error(f"--out {args.out}: no evaluated run of any length-map sweep")
    print(f"{len(here)} run(s) from {args.out}, {len(runs) - len(here)} kept from --previous")
    for path in write_report(runs, Path(args.results)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
