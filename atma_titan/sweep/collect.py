"""Reading the cells back: the `list` lines, and `collect`'s results.md, results.csv and
comparison plots (needle.png, length_curve.png) through atma_titan.eval.report.

Torch-free (the report module is too); matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atma_titan.errors import MissingExtraError
from atma_titan.eval import report
from atma_titan.eval.common import size_label
from atma_titan.atomic import write_text_atomic
from atma_titan.sweep.cells import CellFolder
from atma_titan.sweep.plan import Cell, Plan, short_keys

RESULTS_MD, RESULTS_CSV = "results.md", "results.csv"
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
# The numbers of one cell's results.json


def needle_accuracy(results: dict) -> dict[tuple[str, int], float]:
    """(variant, gap) -> per-digit accuracy, the trial-weighted mean over needle depths."""
    sums: dict[tuple[str, int], list[float]] = {}
    for row in results.get("needle") or []:
        try:
            key = (str(row.get("variant", "access")), int(row["gap"]))
            weight = float(row.get("trials") or 1)
            acc = float(row["digit_acc"])
        except (KeyError, TypeError, ValueError):
            continue
        total = sums.setdefault(key, [0.0, 0.0])
        total[0] += acc * weight
        total[1] += weight
    return {k: s / w for k, (s, w) in sums.items() if w > 0}


def length_nll(results: dict) -> dict[int, float]:
    curve = results.get("length_curve") or {}
    try:
        return {int(n): float(v) for n, v in zip(curve.get("lengths") or [], curve.get("nll") or [])}
    except (TypeError, ValueError):
        return {}


# ---------------------------------------------------------------------------------------------
# The results table


@dataclass
class CellResults:
    cell: Cell
    status: str
    last: dict | None  # the last logged training step
    results: dict | None  # eval/results.json, for a done cell
    accuracy: dict[tuple[str, int], float]
    nll: dict[int, float]


@dataclass
class Table:
    header_md: list[str]
    header_csv: list[str]
    rows_md: list[list[str]]
    rows_csv: list[list[Any]]


def read_cells(plan: Plan, out: Path) -> list[CellResults]:
    read = []
    for cell in plan.cells:
        folder = CellFolder.of(out, cell)
        status = folder.status()
        results = folder.read_results() if status == "done" else None
        acc, nll = (needle_accuracy(results), length_nll(results)) if results else ({}, {})
        read.append(CellResults(cell, status, folder.final_train_metrics(), results, acc, nll))
    return read


def results_table(plan: Plan, cells: list[CellResults]) -> Table:
    """One row per cell: factor values, status, final train loss, accuracy per gap, NLL per length."""
    acc_keys = sorted({k for c in cells for k in c.accuracy}, key=lambda k: (k[0] != "access", k[0], k[1]))
    lengths = sorted({n for c in cells for n in c.nll})
    one_variant = len({v for v, _ in acc_keys}) <= 1
    short = short_keys(plan.factors)
    acc_md = [f"acc@{size_label(g)}" if one_variant else f"{v} acc@{size_label(g)}" for v, g in acc_keys]
    table = Table(
        header_md=["#", *(short[f.key] for f in plan.factors), "status", "train loss", *acc_md]
        + [f"NLL@{size_label(n)}" for n in lengths],
        header_csv=["index", "name", *(f.key for f in plan.factors), "status", "final_step", "final_train_loss"]
        + [f"digit_acc_{v}@{g}" for v, g in acc_keys]
        + [f"nll@{n}" for n in lengths],
        rows_md=[],
        rows_csv=[],
    )
    for c in cells:
        values = [v for _, v in c.cell.overrides]
        loss = c.last["loss"] if c.last else None
        table.rows_md.append(
            [str(c.cell.index), *values, c.status, _fmt(loss, "{:.4f}")]
            + [_fmt(None if k not in c.accuracy else 100 * c.accuracy[k], "{:.1f}") for k in acc_keys]
            + [_fmt(c.nll.get(n), "{:.3f}") for n in lengths]
        )
        table.rows_csv.append(
            [c.cell.index, c.cell.name, *values, c.status, c.last.get("step") if c.last else "", _blank(loss)]
            + [_blank(c.accuracy.get(k)) for k in acc_keys]
            + [_blank(c.nll.get(n)) for n in lengths]
        )
    return table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _blank(value: Any) -> Any:
    return "" if value is None else value


def markdown(plan: Plan, out: Path, table: Table, plots: list[Path]) -> str:
    def row(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    statuses = [r[len(plan.factors) + 1] for r in table.rows_md]
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in ("done", "trained", "failed", "pending") if s in statuses)
    fixed = ", ".join(f"`{k}={v}`" for k, v in plan.fixed) or "none"
    lines = [
        f"# Sweep {out}",
        "",
        f"Base config `{plan.base}`; fixed overrides: {fixed}; eval args: `{plan.eval_args or '(defaults)'}`.",
        f"{len(plan.cells)} cells: {counts}.",
        "",
        row(table.header_md),
        row(["---"] * len(table.header_md)),
        *(row(r) for r in table.rows_md),
        "",
        "train loss: the last logged training loss. acc@gap: per-digit accuracy (%) of the induction needle at "
        "that gap, averaged over needle depths. NLL@length: mean per-token NLL of the length curve. "
        "`-`: not available (cell not finished, or not measured).",
    ]
    if plots:
        lines += ["", *(f"![{p.stem}]({p.name})" for p in plots)]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, table: Table) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(table.header_csv)
    writer.writerows(table.rows_csv)
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
    """Write results.md, results.csv and the plots into the sweep folder; returns what it wrote."""
    cells = read_cells(plan, out)
    table = results_table(plan, cells)
    results_by_name = {c.cell.name: c.results for c in cells if c.results}
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_comparisons(results_by_name, out)
    md, csv_path = out / RESULTS_MD, out / RESULTS_CSV
    write_text_atomic(md, markdown(plan, out, table, plots))
    write_csv(csv_path, table)
    written = [md, csv_path, *plots]
    print(f"collected {len(results_by_name)} evaluated cell(s): " + ", ".join(str(p) for p in written), flush=True)
    return written
