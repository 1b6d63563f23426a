"""Reading the runs back: the `list` lines, and `collect`'s results.md, results.csv and comparison
plots (needle.png, length_curve.png) through atma_titan.eval.report.

With --seeds a cell (a factor combination) is several runs: results.md and results.csv give each
cell's mean and range (min-max, with n; the CSV also the sample std) over its evaluated seeds, and
results_per_seed.csv every run's own numbers; the plots draw each cell's mean. Without seeds each
cell is one run and results.csv is the per-run table. Recall is in percent everywhere.

Torch-free (the report module is too); matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atma_titan.utils.atomic import write_text_atomic
from atma_titan.utils.errors import MissingExtraError
from atma_titan.eval import report
from atma_titan.sweep.cells import CellFolder
from atma_titan.sweep.measures import (
    NLL,
    Measure,
    condition_title,
    csv_column,
    needle_accuracy,
    needle_trials,
    run_measures,
    sort_measures,
    x_label,
)
from atma_titan.sweep.plan import Cell, Plan, short_keys
from atma_titan.sweep.seeds import Spread, mean_results

__all__ = ["collect", "list_cells", "needle_accuracy", "plot_comparisons", "read_cells", "results_table"]

RESULTS_MD, RESULTS_CSV, RESULTS_PER_SEED_CSV = "results.md", "results.csv", "results_per_seed.csv"
STATUSES = ("done", "trained", "failed", "pending")
# (kind: the results.json key, and the png's stem) -> the eval report's multi-model plot
PLOTS = {"needle": report.plot_needle, "length_curve": report.plot_length_curves}


# ---------------------------------------------------------------------------------------------
# list


def list_cells(plan: Plan, out: Path) -> str:
    """One line per cell: index, name, final train loss, status (with a checkpoint or failure)."""
    rows = [("#", "status", "train loss", "name")]
    for cell in plan.cells:
        folder = CellFolder.of(out, cell)
        status = folder.status()
        last = folder.final_train_metrics()
        loss = f"{last['loss']:.4f}" if last else "-"
        if status == "pending" and (step := folder.latest_checkpoint_step()):
            status = f"pending (checkpoint at step {step})"
        elif status == "failed":
            status = "failed: " + folder.failure()
        rows.append((str(cell.index), status, loss, cell.name))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(f"{r[0]:>{width[0]}}  {r[3]:<{width[3]}}  {r[2]:>{width[2]}}  {r[1]}" for r in rows)


# ---------------------------------------------------------------------------------------------
# One run, and one cell (its runs over the seeds)


@dataclass
class CellResults:
    """One run: its status, last logged training step, results.json and the numbers in it."""

    cell: Cell
    status: str
    last: dict | None  # the last logged training step
    results: dict | None  # eval/results.json, for a done run
    measures: dict[Measure, float]

    @property
    def loss(self) -> float | None:
        return self.last["loss"] if self.last else None


@dataclass
class GroupResults:
    """One factor combination: its runs (one per seed; one without seeds) and their spreads."""

    index: int
    name: str
    runs: list[CellResults]

    @property
    def values(self) -> list[str]:
        return [v for _, v in self.runs[0].cell.overrides]

    @property
    def evaluated(self) -> list[CellResults]:
        return [r for r in self.runs if r.results]

    def status(self) -> str:
        """The runs' common status, else the counts ('2 done, 1 pending')."""
        statuses = [r.status for r in self.runs]
        if len(set(statuses)) == 1:
            return statuses[0]
        return ", ".join(f"{statuses.count(s)} {s}" for s in STATUSES if s in statuses)

    def spread(self, measure: Measure) -> Spread | None:
        return Spread.of(r.measures[measure] for r in self.runs if measure in r.measures)

    def loss_spread(self) -> Spread | None:
        """Over the runs whose training finished (a pending run's last loss is mid-training)."""
        return Spread.of(r.loss for r in self.runs if r.loss is not None and r.status in ("done", "trained"))


def read_cells(plan: Plan, out: Path) -> list[CellResults]:
    read = []
    for cell in plan.cells:
        folder = CellFolder.of(out, cell)
        status = folder.status()
        results = folder.read_results() if status == "done" else None
        read.append(CellResults(cell, status, folder.final_train_metrics(), results, run_measures(results)))
    return read


def group_cells(plan: Plan, runs: list[CellResults]) -> list[GroupResults]:
    by_name: dict[str, list[CellResults]] = {}
    for run in runs:
        by_name.setdefault(run.cell.group_name, []).append(run)
    return [GroupResults(i, name, group) for i, (name, group) in enumerate(by_name.items())]


# ---------------------------------------------------------------------------------------------
# The tables


@dataclass
class Table:
    header: list[str]
    rows: list[list[Any]]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _blank(value: Any) -> Any:
    return "" if value is None else value


def _spec(measure: Measure) -> str:
    return "{:.3f}" if measure.metric == NLL else "{:.1f}"


def _columns(measures: list[Measure]) -> dict[Measure, str]:
    needle = [m for m in measures if m.metric != NLL]
    many_depths = len({m.depth for m in needle}) > 1
    many_modes = len({m.mode for m in needle}) > 1
    return {m: csv_column(m, many_depths, many_modes) for m in measures}


def results_table(plan: Plan, runs: list[CellResults]) -> Table:
    """The per-run CSV: one row per run with factor values (and cell / seed with --seeds), status,
    last step and loss, and every measure (recall in %, NLL in nats)."""
    measures = sort_measures(m for r in runs for m in r.measures)
    columns = _columns(measures)
    seeded = plan.seeds is not None
    header = ["index", "name", *(["cell", "seed"] if seeded else []), *(f.key for f in plan.factors)]
    header += ["status", "final_step", "final_train_loss", *columns.values()]
    rows = []
    for r in runs:
        seed = [r.cell.group_name, r.cell.seed] if seeded else []
        row = [r.cell.index, r.cell.name, *seed, *(v for _, v in r.cell.overrides), r.status]
        row += [r.last.get("step") if r.last else "", _blank(r.loss)]
        rows.append(row + [_blank(r.measures.get(m)) for m in measures])
    return Table(header, rows)


def seeds_table(plan: Plan, groups: list[GroupResults]) -> Table:
    """The per-cell CSV over seeds: for the final loss and every measure its mean, sample std, min,
    max and n (the seeds it was measured on)."""
    measures = sort_measures(m for g in groups for r in g.runs for m in r.measures)
    columns = _columns(measures)
    header = ["cell_index", "cell", *(f.key for f in plan.factors), "seeds", "runs_done", "status"]
    for name in ["final_train_loss", *columns.values()]:
        header += [f"{name}_{stat}" for stat in ("mean", "std", "min", "max", "n")]
    rows = []
    for g in groups:
        row = [g.index, g.name, *g.values, len(g.runs), sum(r.status == "done" for r in g.runs), g.status()]
        for spread in [g.loss_spread(), *(g.spread(m) for m in measures)]:
            row += [spread.mean, _blank(spread.std), spread.low, spread.high, spread.n] if spread else [""] * 4 + [0]
        rows.append(row)
    return Table(header, rows)


def markdown_tables(plan: Plan, groups: list[GroupResults]) -> list[str]:
    """The summary table, then one table per condition (metric, variant, depth, mode) with a column
    per gap / length. With seeds: mean (min-max) over each cell's evaluated seeds."""
    seeded = plan.seeds is not None
    short = short_keys(plan.factors)
    factors = [short[f.key] for f in plan.factors]
    measures = sort_measures(m for g in groups for r in g.runs for m in r.measures)

    def row(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    def table(header: list[str], rows: list[list[str]]) -> list[str]:
        return [row(header), row(["---"] * len(header)), *(row(r) for r in rows)]

    summary_header = ["#", *factors, *(["seeds done"] if seeded else []), "status", "train loss"]
    summary = []
    for g in groups:
        loss = g.loss_spread() if seeded else Spread.of([g.runs[0].loss] if g.runs[0].loss is not None else [])
        n_done = sum(r.status == "done" for r in g.runs)
        done = [f"{n_done}/{len(g.runs)}"] if seeded else []
        loss_text = loss.text("{:.4f}", len(g.runs) if seeded else 1) if loss else "-"
        summary.append([str(g.index), *g.values, *done, g.status(), loss_text])
    lines = table(summary_header, summary)

    conditions: dict[tuple, list[Measure]] = {}
    for m in measures:
        conditions.setdefault(m.condition, []).append(m)
    for condition, columns in conditions.items():
        rows = []
        for g in groups:
            n = len(g.evaluated)
            values = [(g.spread(m), _spec(m)) for m in columns]
            cells = [s.text(spec, n) if s else "-" for s, spec in values]
            rows.append([str(g.index), *g.values, *([str(n)] if seeded else []), *cells])
        header = ["#", *factors, *(["n"] if seeded else []), *(x_label(m) for m in columns)]
        lines += ["", f"### {condition_title(condition)}", "", *table(header, rows)]
    return lines


def markdown(plan: Plan, out: Path, groups: list[GroupResults], runs: list[CellResults], plots: list[Path]) -> str:
    seeded = plan.seeds is not None
    statuses = [r.status for r in runs]
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in STATUSES if s in statuses)
    fixed = ", ".join(f"`{k}={v}`" for k, v in plan.fixed) or "none"
    trials = sorted({t for r in runs for t in needle_trials(r.results)})
    lines = [
        f"# Sweep {out}",
        "",
        f"Base config `{plan.base}`; fixed overrides: {fixed}; eval args: `{plan.eval_args or '(defaults)'}`.",
        f"{plan.describe_runs()}: {counts}."
        + (f" Needle trials per gap and depth: {', '.join(map(str, trials))}." if trials else ""),
        "",
        *markdown_tables(plan, groups),
        "",
        "train loss: the last logged training loss. Recall: exact 5/5 (every value digit right) and per-digit, "
        "in percent of the trials. NLL: mean per-token NLL of the length curve at each prefix length. "
        "`-`: not available (not finished, or not measured).",
    ]
    if seeded:
        lines += [
            "",
            "Over seeds: each value is the mean over the cell's runs (training seeds, `job.seed`) that measured it, "
            "with the range (min-max) across them in brackets; `n` is the number of evaluated seeds (a value "
            "measured on fewer says `n=`). The train loss is over the seeds that finished training. Every run's "
            f"own numbers: `{RESULTS_PER_SEED_CSV}`; standard deviations: `{RESULTS_CSV}`. The plots draw the means.",
        ]
    if plots:
        lines += ["", *(f"![{p.stem}]({p.name})" for p in plots)]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, table: Table) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(table.header)
    writer.writerows(table.rows)
    write_text_atomic(path, buffer.getvalue())


# ---------------------------------------------------------------------------------------------
# Plots, and collect


def plot_comparisons(results_by_name: dict[str, dict], out: Path) -> list[Path]:
    """needle.png and length_curve.png over all evaluated cells (a kind no cell measured is left out).
    Without matplotlib: a warning and no plots, so that the table still comes out."""
    written = []
    for kind, plot in PLOTS.items():
        if not any(r.get(kind) for r in results_by_name.values()):
            continue
        path = out / f"{kind}.png"
        try:
            plot(results_by_name, path)
        except MissingExtraError as e:
            print(f"warning: no plots: {e}", flush=True)
            break
        written.append(path)
    return written


def collect(plan: Plan, out: Path) -> list[Path]:
    """Write results.md, results.csv (and with seeds results_per_seed.csv) and the plots into the
    sweep folder; returns what it wrote."""
    runs = read_cells(plan, out)
    groups = group_cells(plan, runs)
    seeded = plan.seeds is not None
    # One line per cell in the plots: with seeds, the mean over its evaluated seeds.
    results_by_name = {
        g.name: mean_results(g.name, [r.results for r in g.evaluated]) if seeded else g.evaluated[0].results
        for g in groups
        if g.evaluated
    }
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_comparisons(results_by_name, out)
    md, csv_path = out / RESULTS_MD, out / RESULTS_CSV
    write_text_atomic(md, markdown(plan, out, groups, runs, plots))
    written = [md, csv_path]
    if seeded:
        write_csv(csv_path, seeds_table(plan, groups))
        write_csv(out / RESULTS_PER_SEED_CSV, results_table(plan, runs))
        written.append(out / RESULTS_PER_SEED_CSV)
    else:
        write_csv(csv_path, results_table(plan, runs))
    written += plots
    evaluated = sum(1 for r in runs if r.results)
    what = f"run(s) of {len(groups)} cells" if seeded else "cell(s)"
    print(f"collected {evaluated} evaluated {what}: " + ", ".join(str(p) for p in written), flush=True)
    return written
