"""The evaluation plots: needle recall and length curves that a reader can trust.

* Needle (`plot_needle`): two panels side by side, exact recall (the whole value right) and per-digit
  accuracy, both in percent (0-100) against the gap; they are different questions (a model at 80%
  per digit may get only a third of the values whole), so they never share a line.
* One series per model x (mode, variant, depth), with the same colour and marker in both panels;
  generated rows are dashed.
* Lines that coincide stay visible: every point has a marker and each series is dodged on x by a few
  hundredths of an octave (the tick labels stay at the true gaps); the numbers are in results.md.
* The training length, from each results' `train_seq_len` (the run's `training.seq_len`, written by
  the eval command) or the `train_len` argument, is a dotted vertical line labelled "trained at 2K".
* x is log2 with the gaps as labels (128, 512, 1K, ...).

`needle_panels` and `length_series` return the plotted numbers (tests, and any caller that wants
them without drawing); `needle_figure` and `length_figure` the matplotlib Figure. Everything takes
{name: results dict} (the results.json schema, atma_titan.eval.report), so a sweep's collector can
draw all its cells on one figure. matplotlib is imported only when a figure is drawn, through its
object-oriented API (Figure + the Agg canvas): no pyplot state or GUI backend is touched in the
caller's process. Torch-free.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from atma_titan.utils.errors import import_optional
from atma_titan.eval.common import size_label

__all__ = [
    "Panel",
    "Series",
    "conditions",
    "depth_label",
    "dodge_factors",
    "length_figure",
    "length_series",
    "log2_axis",
    "mark_training_length",
    "needle_figure",
    "needle_panels",
    "plot_length_curves",
    "plot_needle",
    "train_lengths",
]

TEACHER_FORCED, GENERATED = "teacher_forced", "generated"  # as in atma_titan.eval.needle (torch-free here)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
DODGE_OCTAVES = 0.06  # x shift between neighbouring series; the whole spread is capped at MAX_SPREAD
MAX_SPREAD_OCTAVES = 0.45
NEEDLE_WIDTH_CHARS, LENGTH_WIDTH_CHARS = 120, 76  # legend characters (fontsize small) across each figure


@dataclass(frozen=True)
class Series:
    """One line: `x` the true gaps (or lengths), `y` in its panel's unit (percent for the needle)."""

    label: str
    model: str
    mode: str
    variant: str
    depth: float | None
    x: list[int]
    y: list[float]


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    series: list[Series]


def _mode(entry: dict) -> str:
    return entry.get("mode") or TEACHER_FORCED


def depth_label(depth: float) -> str:
    return "before haystack" if depth == 0 else f"{depth:.0%}"


def conditions(needle: list[dict]) -> dict[tuple[str, str, float], list[dict]]:
    """(mode, variant, depth) -> its rows sorted by gap; teacher-forced conditions first."""
    groups: dict[tuple[str, str, float], list[dict]] = defaultdict(list)
    for entry in needle:
        groups[(_mode(entry), entry["variant"], float(entry["depth"]))].append(entry)
    order = sorted(groups.items(), key=lambda kv: (kv[0][0] != TEACHER_FORCED,) + kv[0])
    return {k: sorted(v, key=lambda e: e["gap"]) for k, v in order}


def _percent_series(label: str, model: str, key: tuple, entries: list[dict], field: str) -> Series:
    rows = [e for e in entries if e.get(field) is not None]  # an old row may lack exact_acc
    mode, variant, depth = key
    return Series(label, model, mode, variant, depth, [int(e["gap"]) for e in rows], [100 * e[field] for e in rows])


def _labels(keys: list[tuple[str, tuple[str, str, float]]]) -> list[str]:
    """A legend label per (model, condition) naming only what tells the lines apart (all of it for one line)."""
    models = {m for m, _ in keys}
    variants, depths = {k[1] for _, k in keys}, {k[2] for _, k in keys}
    labels = []
    for model, (mode, variant, depth) in keys:
        parts = [model] if len(models) > 1 or len(keys) == 1 else []
        parts += [variant] if len(variants) > 1 or len(keys) == 1 else []
        parts += [f"depth {depth_label(depth)}"] if len(depths) > 1 or len(keys) == 1 else []
        parts += [f"({mode})"] if mode != TEACHER_FORCED else []
        labels.append(" ".join(parts) or "teacher-forced")  # only the mode tells it from its generated twin
    return labels


def needle_panels(results_by_name: Mapping[str, dict]) -> list[Panel]:
    """[exact recall panel, per-digit accuracy panel], each with one series per model x condition, in %."""
    rows = [
        (name, key, entries)
        for name, results in results_by_name.items()
        for key, entries in conditions((results or {}).get("needle") or []).items()
    ]
    labels = _labels([(name, key) for name, key, _ in rows])
    exact = [_percent_series(label, n, k, e, "exact_acc") for label, (n, k, e) in zip(labels, rows)]
    digit = [_percent_series(label, n, k, e, "digit_acc") for label, (n, k, e) in zip(labels, rows)]
    all_records = all(k[1] == "records" for _, k, _ in rows)
    name, unit = ("per-token", "value tokens") if all_records and exact else ("per-digit", "digits")
    return [
        Panel("exact recall: the whole value right", "exact recall (% of trials)", exact),
        Panel(f"{name} accuracy", f"{name} accuracy (% of {unit})", digit),
    ]


def length_series(results_by_name: Mapping[str, dict]) -> list[Series]:
    """One NLL-vs-length series per model that has a length curve (nats per token)."""
    out = []
    for name, results in results_by_name.items():
        curve = (results or {}).get("length_curve")
        if curve:
            label = f"{name} ({curve['documents']} docs)"
            out.append(Series(label, name, TEACHER_FORCED, "length", None, list(curve["lengths"]), list(curve["nll"])))
    return out


def train_lengths(results_by_name: Mapping[str, dict], train_len: int | None = None) -> dict[int, list[str]]:
    """Training length -> the models trained at it: `train_len` for all, else each results' `train_seq_len`."""
    out: dict[int, list[str]] = defaultdict(list)
    for name, results in results_by_name.items():
        length = train_len if train_len is not None else (results or {}).get("train_seq_len")
        if length:
            out[int(length)].append(name)
    return dict(out)


# ---------------------------------------------------------------------------------------------
# Drawing


def _figure(width: float, height: float, panels: int = 1):
    backend = import_optional("matplotlib.backends.backend_agg", "eval", "the evaluation plots", "matplotlib")
    figure = import_optional("matplotlib.figure", "eval", "the evaluation plots", "matplotlib")
    fig = figure.Figure(figsize=(width, height), layout="constrained")
    backend.FigureCanvasAgg(fig)  # render with Agg whatever pyplot's backend in this process is
    axes = fig.subplots(1, panels, sharey=True, squeeze=False)[0]
    return fig, list(axes)


def log2_axis(ax, values: list[int]) -> None:
    """log2 x axis ticked and labelled at `values` (128, 512, 1K, ...)."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(values))
    ax.set_xticks(ticks)
    ax.set_xticklabels([size_label(v) for v in ticks])
    ax.minorticks_off()


def dodge_factors(count: int) -> list[float]:
    """Multiplicative x shifts, centred on 1, that keep `count` coinciding series apart on a log2 axis."""
    if count <= 1:
        return [1.0] * count
    step = min(DODGE_OCTAVES, MAX_SPREAD_OCTAVES / (count - 1))
    return [2 ** ((i - (count - 1) / 2) * step) for i in range(count)]


def _draw(ax, series: list[Series]) -> None:
    for i, (s, factor) in enumerate(zip(series, dodge_factors(len(series)))):
        ax.plot(
            [x * factor for x in s.x], s.y, label=s.label, color=f"C{i % 10}", marker=MARKERS[i % len(MARKERS)],
            markersize=5, linewidth=1.4, alpha=0.9, linestyle="--" if s.mode == GENERATED else "-",
        )  # fmt: skip


def mark_training_length(ax, lengths: dict[int, list[str]]) -> None:
    """A dotted vertical line per training length, labelled at the top (with the models when they differ)."""
    for length, names in sorted(lengths.items()):
        ax.axvline(length, color="0.35", linestyle=":", linewidth=1.3, zorder=0)
        text = f"trained at {size_label(length)}" + (f" ({', '.join(names)})" if len(lengths) > 1 else "")
        ax.text(
            length, 0.5, text, transform=ax.get_xaxis_transform(), rotation=90, ha="right", va="center",
            fontsize="small", color="0.25", bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1},
        )  # fmt: skip


def _legend_columns(labels: list[str], width_chars: int) -> int:
    return max(1, min(len(labels), width_chars // (max(map(len, labels), default=1) + 8)))


def _height(labels: list[str], width_chars: int) -> float:
    """Plot height plus a legend row per `_legend_columns` labels below it (no legend for one line)."""
    rows = -(-len(labels) // _legend_columns(labels, width_chars)) if len(labels) > 1 else 0
    return 4.6 + 0.22 * rows


def _legend(fig, ax, width_chars: int) -> None:
    """One line: a legend inside the axes; several: one legend under all panels."""
    handles, labels = ax.get_legend_handles_labels()
    if len(labels) == 1:
        ax.legend(fontsize="small")
    elif labels:
        ncols = _legend_columns(labels, width_chars)
        fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize="small")


def needle_figure(results_by_name: Mapping[str, dict], *, train_len: int | None = None):
    """The needle Figure: exact recall and per-digit accuracy (%) vs gap, side by side (module docstring)."""
    panels = needle_panels(results_by_name)
    labels = [s.label for s in panels[0].series]
    fig, axes = _figure(11.0, _height(labels, NEEDLE_WIDTH_CHARS), panels=len(panels))
    lengths = train_lengths(results_by_name, train_len)
    gaps = [x for p in panels for s in p.series for x in s.x]
    modes = {s.mode for p in panels for s in p.series}
    for ax, panel in zip(axes, panels):
        _draw(ax, panel.series)
        if gaps:
            log2_axis(ax, gaps)
        mark_training_length(ax, lengths)
        ax.set_ylim(-3, 103)
        ax.set_yticks([0, 25, 50, 75, 100])
        ax.set_xlabel("gap (haystack tokens between the needle and the query)")
        ax.set_ylabel(panel.ylabel)
        ax.set_title(panel.title)
        ax.grid(True, alpha=0.3)
        ax.yaxis.set_tick_params(labelleft=True)  # sharey hides the right panel's labels; keep them
    how = " / ".join(("teacher-forced" if m == TEACHER_FORCED else "generated (dashed)") for m in sorted(modes))
    fig.suptitle(f"Induction needle ({how})" if how else "Induction needle")
    _legend(fig, axes[0], NEEDLE_WIDTH_CHARS)
    return fig


def length_figure(results_by_name: Mapping[str, dict], *, train_len: int | None = None):
    """The length-curve Figure: mean NLL per token (nats) vs prefix length, one line per model."""
    series = length_series(results_by_name)
    fig, (ax,) = _figure(7.0, _height([s.label for s in series], LENGTH_WIDTH_CHARS))
    _draw(ax, series)
    lengths = [x for s in series for x in s.x]
    if lengths:
        log2_axis(ax, lengths)
    mark_training_length(ax, train_lengths(results_by_name, train_len))
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("mean NLL per token (nats)")
    ax.set_title("Length curve")
    ax.grid(True, alpha=0.3)
    _legend(fig, ax, LENGTH_WIDTH_CHARS)
    return fig


def plot_needle(results_by_name: Mapping[str, dict], path: str | Path, *, train_len: int | None = None) -> Path:
    """Draw `needle_figure` to `path` (PNG at 120 dpi)."""
    needle_figure(results_by_name, train_len=train_len).savefig(path, dpi=120)
    return Path(path)


def plot_length_curves(results_by_name: Mapping[str, dict], path: str | Path, *, train_len: int | None = None) -> Path:
    """Draw `length_figure` to `path` (PNG at 120 dpi)."""
    length_figure(results_by_name, train_len=train_len).savefig(path, dpi=120)
    return Path(path)
