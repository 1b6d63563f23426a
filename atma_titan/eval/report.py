"""Writing evaluation results: results.json, results.md, needle.png and length_curve.png.

results.json (read by the sweep collector; keep the schema)::

    {"name": str, "checkpoint": str, "step": int | null, "tokenizer": str,
     "needle": [{"variant": "access" | "passkey" | "records", "gap": int, "depth": float, "trials": int,
                 "digit_acc": float, "exact_acc": float, "ce": float | null, "control_ce": float | null,
                 "mode": "teacher_forced" | "generated"}, ...],
     "length_curve": {"lengths": [int], "nll": [float], "documents": int} | null}

`mode` "generated" (eval --generate): the digits the model wrote free-running; its `ce` and
`control_ce` are null. A row without `mode` (results written before it existed) is teacher-forced.

`plot_needle` and `plot_length_curves` take {name: results dict} and draw every model on one
figure, so a sweep can compare its cells. matplotlib is imported only when a plot is drawn, and
through its object-oriented API (Figure + the Agg canvas), so no pyplot state or GUI backend is
touched in the caller's process.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from atma_titan.atomic import write_json_atomic
from atma_titan.errors import import_optional
from atma_titan.eval.common import size_label

__all__ = ["needle_markdown", "plot_length_curves", "plot_needle", "results_markdown", "write_results"]

RESULTS_JSON, RESULTS_MD, NEEDLE_PNG, LENGTH_PNG = "results.json", "results.md", "needle.png", "length_curve.png"


TEACHER_FORCED, GENERATED = "teacher_forced", "generated"  # as in atma_titan.eval.needle (torch-free here)
MODE_TITLE = {TEACHER_FORCED: "teacher-forced", GENERATED: "generated, greedy free-running"}


def _mode(entry: dict) -> str:
    return entry.get("mode") or TEACHER_FORCED


def _condition(entry: dict) -> tuple[str, str, float]:
    return _mode(entry), entry["variant"], float(entry["depth"])


def _depth_label(depth: float) -> str:
    return "before haystack" if depth == 0 else f"{depth:.0%}"


def _by_condition(needle: list[dict]) -> dict[tuple[str, str, float], list[dict]]:
    """(mode, variant, depth) -> its rows by gap; teacher-forced conditions first."""
    groups: dict[tuple[str, str, float], list[dict]] = defaultdict(list)
    for entry in needle:
        groups[_condition(entry)].append(entry)
    order = sorted(groups.items(), key=lambda kv: (kv[0][0] != TEACHER_FORCED,) + kv[0])
    return {k: sorted(v, key=lambda e: e["gap"]) for k, v in order}


def _number(value) -> str:
    return "" if value is None else f"{value:.3f}"


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def needle_markdown(needle: list[dict]) -> str:
    """Per-digit accuracy by gap (columns) for each variant and depth, then every number per condition;
    one such section per scoring mode present (teacher-forced, generated)."""
    gaps = sorted({e["gap"] for e in needle})
    groups = _by_condition(needle)
    sections = []
    for mode in dict.fromkeys(m for m, _, _ in groups):
        summary, detail = [], []
        for (_, variant, depth), entries in ((k, v) for k, v in groups.items() if k[0] == mode):
            acc = {e["gap"]: f"{e['digit_acc']:.3f}" for e in entries}
            summary.append([variant, _depth_label(depth)] + [acc.get(g, "") for g in gaps])
            for e in entries:
                row = [variant, _depth_label(depth), size_label(e["gap"]), str(e["trials"])]
                row += [f"{e['digit_acc']:.3f}", f"{e['exact_acc']:.3f}"]
                if mode != GENERATED:
                    row += [_number(e.get("ce")), _number(e.get("control_ce"))]
                detail.append(row)
        header = ["variant", "depth", "gap", "trials", "digit acc", "exact 5/5"]
        if mode == GENERATED:
            note = (
                "the value written greedily after the query's cue, free-running; exact: every value token right, "
                "the spaces between digits included; no CE"
            )
        else:
            note = "CE in nats over the 5 value digits; control: the same sequence without the needle"
            header += ["CE", "control CE"]
        title = MODE_TITLE.get(mode, mode)
        sections += [
            f"## Induction needle ({title}): per-digit accuracy by gap",
            _table(["variant", "depth"] + [size_label(g) for g in gaps], summary),
            f"### Every condition ({note})",
            _table(header, detail),
        ]
    return "\n\n".join(sections)


def results_markdown(results: dict) -> str:
    parts = [
        f"# Evaluation: {results['name']}",
        f"checkpoint `{results['checkpoint']}`, step {results['step']}, tokenizer `{results['tokenizer']}`",
    ]
    if results.get("needle"):
        parts.append(needle_markdown(results["needle"]))
    curve = results.get("length_curve")
    if curve:
        rows = [[size_label(n), f"{v:.4f}"] for n, v in zip(curve["lengths"], curve["nll"])]
        parts += [
            f"## Length curve: mean NLL per token on nested prefixes of {curve['documents']} documents",
            _table(["length", "NLL (nats/token)"], rows),
        ]
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


def _figure(width: float = 7.0, height: float = 4.5):
    backend = import_optional("matplotlib.backends.backend_agg", "eval", "the evaluation plots", "matplotlib")
    figure = import_optional("matplotlib.figure", "eval", "the evaluation plots", "matplotlib")
    fig = figure.Figure(figsize=(width, height), layout="constrained")
    backend.FigureCanvasAgg(fig)  # render with Agg whatever pyplot's backend in this process is
    return fig, fig.add_subplot()


def _log2_axis(ax, values: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(values))
    ax.set_xticks(ticks)
    ax.set_xticklabels([size_label(v) for v in ticks])
    ax.minorticks_off()


def plot_needle(results_by_name: dict[str, dict], path: str | Path) -> Path:
    """Per-digit accuracy vs gap (log2 axis): one line per model x variant x depth x mode (generated: dashed)."""
    fig, ax = _figure()
    several = len(results_by_name) > 1
    gaps: list[int] = []
    for name, results in results_by_name.items():
        groups = _by_condition(results.get("needle") or [])
        name_it, condition_it = several, len(groups) > 1 or not several  # label only what tells lines apart
        for (mode, variant, depth), entries in groups.items():
            label = ([name] if name_it else []) + ([variant, f"depth {_depth_label(depth)}"] if condition_it else [])
            if mode != TEACHER_FORCED:
                label.append(f"({mode})")
            xs = [e["gap"] for e in entries]
            gaps += xs
            ax.plot(
                xs, [e["digit_acc"] for e in entries], marker="o", label=" ".join(label),
                linestyle="--" if mode == GENERATED else "-",
            )  # fmt: skip
    if gaps:
        _log2_axis(ax, gaps)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("gap (haystack tokens)")
    ax.set_ylabel("per-digit accuracy")
    ax.set_title("Induction needle")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_length_curves(results_by_name: dict[str, dict], path: str | Path) -> Path:
    """Mean NLL per token vs prefix length (log2 axis): one line per model."""
    fig, ax = _figure()
    lengths: list[int] = []
    for name, results in results_by_name.items():
        curve = results.get("length_curve")
        if curve:
            lengths += curve["lengths"]
            ax.plot(curve["lengths"], curve["nll"], marker="o", label=f"{name} ({curve['documents']} docs)")
    if lengths:
        _log2_axis(ax, lengths)
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("mean NLL per token (nats)")
    ax.set_title("Length curve")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return Path(path)


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
