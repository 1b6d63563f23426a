"""Writing evaluation results: results.json, results.md, needle.png and length_curve.png.

results.json (read by the sweep collector; keep the schema)::

    {"name": str, "checkpoint": str, "step": int | null, "tokenizer": str,
     "train_seq_len": int,  # the run's training.seq_len, marked on the plots (absent in older files)
     "units": {...},        # RESULT_UNITS: what each number is measured in (absent in older files)
     "needle": [{"variant": "access" | "passkey" | "records", "gap": int, "depth": float, "trials": int,
                 "digit_acc": float, "exact_acc": float, "ce": float | null, "control_ce": float | null,
                 "mode": "teacher_forced" | "generated"}, ...],
     "length_curve": {"lengths": [int], "nll": [float], "documents": int} | null,
     "over_training": [{"step": int, "needle": [...as above...]}, ...]}  # only with eval --steps

With --steps the top-level numbers are the last step's, and over_training holds the needle at every
evaluated step, the last included.

Accuracies stay fractions (0-1) in results.json, as machines read them; results.md, the plots and
the progress lines show them in percent, one unit everywhere a person reads them.

`mode` "generated" (eval --generate): the digits the model wrote free-running; its `ce` and
`control_ce` are null. A row without `mode` (results written before it existed) is teacher-forced.

The plots are atma_titan.eval.plots' (`plot_needle` and `plot_length_curves`, re-exported here):
they take {name: results dict} and draw every model on one figure, so a sweep can compare its cells.
"""

from __future__ import annotations

from pathlib import Path

from atma_titan.utils.atomic import write_json_atomic
from atma_titan.eval.common import size_label
from atma_titan.eval.plots import GENERATED, TEACHER_FORCED, conditions, depth_label, plot_length_curves, plot_needle

__all__ = [
    "RESULT_UNITS",
    "gap_header",
    "markdown_table",
    "needle_markdown",
    "over_training_markdown",
    "plot_length_curves",
    "plot_needle",
    "results_markdown",
    "write_results",
]

RESULTS_JSON, RESULTS_MD, NEEDLE_PNG, LENGTH_PNG = "results.json", "results.md", "needle.png", "length_curve.png"

RESULT_UNITS = {
    "gap": "tokens of haystack between the needle and the query",
    "depth": "fraction (0-1) of the gap's haystack before the needle",
    "digit_acc": "fraction (0-1) of value digits (records: value tokens) predicted right",
    "exact_acc": "fraction (0-1) of trials with the whole value right",
    "ce": "nats per value digit (token)",
    "control_ce": "nats per value digit (token)",
    "length_curve.lengths": "tokens",
    "length_curve.nll": "nats per token",
    "train_seq_len": "tokens",
}

MODE_TITLE = {TEACHER_FORCED: "teacher-forced", GENERATED: "generated, greedy free-running"}


def _number(value) -> str:
    return "" if value is None else f"{value:.3f}"


def percent(fraction: float | None) -> str:
    """0.906 -> '90.6' (the tables' one unit: percent, one decimal, as the sweep's results.md)."""
    return "" if fraction is None else f"{100 * fraction:.1f}"


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def gap_header(gap: int, train_len: int | None) -> str:
    """'4K', or '4K (32x)' when the training length is known: how far past it the gap reaches."""
    return size_label(gap) + (f" ({gap / train_len:g}x)" if train_len else "")


def needle_markdown(needle: list[dict], train_len: int | None = None) -> str:
    """Exact recall and per-digit accuracy (%) by gap (columns) for each variant and depth, then every
    number per condition; one such section per scoring mode present (teacher-forced, generated)."""
    gaps = sorted({e["gap"] for e in needle})
    groups = conditions(needle)
    sections = []
    for mode in dict.fromkeys(m for m, _, _ in groups):
        in_mode = [(k, v) for k, v in groups.items() if k[0] == mode]
        records = all(variant == "records" for (_, variant, _), _ in in_mode)
        # a record's value is a few tokens, the text needle's 5 digits
        exact_name, acc_name, unit = (
            ("exact", "per-token", "value token") if records else ("exact 5/5", "per-digit", "digit")
        )
        exact_rows, digit_rows, detail = [], [], []
        for (_, variant, depth), entries in in_mode:
            by_gap = {e["gap"]: e for e in entries}
            lead = [variant, depth_label(depth)]
            exact_rows.append(lead + [percent(by_gap[g].get("exact_acc")) if g in by_gap else "" for g in gaps])
            digit_rows.append(lead + [percent(by_gap[g]["digit_acc"]) if g in by_gap else "" for g in gaps])
            for e in entries:
                row = lead + [size_label(e["gap"]), str(e["trials"]), percent(e.get("exact_acc"))]
                row += [percent(e["digit_acc"])]
                if mode != GENERATED:
                    row += [_number(e.get("ce")), _number(e.get("control_ce"))]
                detail.append(row)
        header = ["variant", "depth", "gap", "trials", f"{exact_name} (%)", f"{acc_name} acc (%)"]
        if mode == GENERATED:
            note = (
                "the value written greedily after the query's cue, free-running; exact: every value token right, "
                "the spaces between digits included; no CE"
            )
        else:
            per = "value token" if records else "value digit"
            note = f"CE in nats per {per}; control: the same sequence without the needle"
            header += ["CE (nats)", "control CE (nats)"]
        title = MODE_TITLE.get(mode, mode)
        columns = ["variant", "depth"] + [gap_header(g, train_len) for g in gaps]
        sections += [
            f"## Induction needle ({title}): {exact_name} recall (% of trials) by gap",
            markdown_table(columns, exact_rows),
            f"## Induction needle ({title}): {acc_name} accuracy (% of {unit}s) by gap",
            markdown_table(columns, digit_rows),
            f"### Every condition ({note})",
            markdown_table(header, detail),
        ]
    return "\n\n".join(sections)


def over_training_markdown(over_training: list[dict], train_len: int | None = None) -> str:
    """Exact recall (%) at each step (rows) for each condition and gap (columns), in `conditions`' order."""
    by_step = {
        entry["step"]: {(*key, e["gap"]): e for key, rows in conditions(entry["needle"]).items() for e in rows}
        for entry in over_training
    }
    columns = list(dict.fromkeys(c for cells in by_step.values() for c in cells))
    header = ["step"] + [
        f"{gap_header(gap, train_len)} {depth_label(depth)}" + ("" if mode == TEACHER_FORCED else " generated")
        + (f" {variant}" if variant not in ("records", "access") else "")
        for mode, variant, depth, gap in columns
    ]  # fmt: skip
    rows = [
        [str(step)] + [percent(cells[c]["exact_acc"]) if c in cells else "" for c in columns]
        for step, cells in sorted(by_step.items())
    ]
    return "## Exact recall (%) over training\n\n" + markdown_table(header, rows)


def results_markdown(results: dict) -> str:
    train_len = results.get("train_seq_len")
    trained = f", trained at seq_len {train_len}" if train_len else ""
    parts = [
        f"# Evaluation: {results['name']}",
        f"checkpoint `{results['checkpoint']}`, step {results['step']}, tokenizer `{results['tokenizer']}`{trained}",
        "Accuracies in percent; depth: the share of the gap's haystack before the needle "
        "(before haystack = the needle right after EOT).",
    ]
    if results.get("needle"):
        parts.append(needle_markdown(results["needle"], train_len))
    curve = results.get("length_curve")
    if curve:
        rows = [[size_label(n), f"{v:.4f}"] for n, v in zip(curve["lengths"], curve["nll"])]
        parts += [
            f"## Length curve: mean NLL per token on nested prefixes of {curve['documents']} documents",
            markdown_table(["length", "NLL (nats/token)"], rows),
        ]
    if results.get("over_training"):
        parts.append(over_training_markdown(results["over_training"], train_len))
    return "\n\n".join(parts) + "\n"


def write_results(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """results.json and results.md, plus needle.png / length_curve.png when there is something to plot."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"json": out / RESULTS_JSON, "markdown": out / RESULTS_MD}
    write_json_atomic(written["json"], results)  # a collector never reads half a file
    written["markdown"].write_text(results_markdown(results))
    one = {results["name"]: results}
    if results.get("needle"):
        written["needle_plot"] = plot_needle(one, out / NEEDLE_PNG)
    if results.get("length_curve"):
        written["length_plot"] = plot_length_curves(one, out / LENGTH_PNG)
    return written
