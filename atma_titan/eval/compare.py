"""Several evaluations side by side, from the results.json files the eval command wrote (the command:
`python -m atma_titan.compare`).

The output folder gets results.md (exact and per-token recall by gap, one row per model and
condition, in percent; the length curves' NLL when any model has one), needle.png and
length_curve.png with every model on one figure (atma_titan.eval.plots). A folder argument means
its results.json. Runs no model and needs no torch: the numbers are the files', so the comparison
and each eval's results.md agree.
"""

from __future__ import annotations

import json
from pathlib import Path

from atma_titan.utils.atomic import write_text_atomic
from atma_titan.eval.common import EvalInputError, size_label
from atma_titan.eval.plots import conditions, depth_label
from atma_titan.eval.report import (
    LENGTH_PNG,
    MODE_TITLE,
    NEEDLE_PNG,
    RESULTS_JSON,
    RESULTS_MD,
    gap_header,
    markdown_table,
    percent,
    plot_length_curves,
    plot_needle,
)

__all__ = ["comparison_markdown", "load_results", "write_comparison"]


def load_results(paths: list[str], names: list[str] | None = None) -> dict[str, dict]:
    """{label: results dict} in the order given; labels from `names` or each file's own `name`."""
    if names is not None and len(names) != len(paths):
        raise EvalInputError(f"--names has {len(names)} label(s) for {len(paths)} results file(s); give one each")
    if names is not None and not all(names):
        raise EvalInputError(f"--names {','.join(names)!r} has an empty label; give each results file a name")
    loaded: dict[str, dict] = {}
    for i, given in enumerate(paths):
        path = Path(given)
        if path.is_dir():
            path = path / RESULTS_JSON
        try:
            results = json.loads(path.read_text())
        except FileNotFoundError:
            raise EvalInputError(f"{path}: no such file (the eval command writes <run>/eval/{RESULTS_JSON})") from None
        except (OSError, json.JSONDecodeError) as e:
            raise EvalInputError(f"{path}: not a readable results.json ({e})") from None
        if not isinstance(results, dict) or not (results.get("needle") or results.get("length_curve")):
            raise EvalInputError(f"{path}: holds no needle rows and no length curve: nothing to compare")
        label = names[i] if names else str(results.get("name") or path.parent.name)
        if label in loaded:
            raise EvalInputError(f"two results are named {label!r} ({path}); tell them apart with --names")
        loaded[label] = results
    return loaded


def _train_len(results_by_name: dict[str, dict]) -> int | None:
    """The one training length all models share, else None (the table then shows gaps only)."""
    lengths = {r.get("train_seq_len") for r in results_by_name.values()}
    return lengths.pop() if len(lengths) == 1 else None


def _needle_tables(results_by_name: dict[str, dict], train_len: int | None) -> list[str]:
    rows = [
        (name, key, entries)
        for name, results in results_by_name.items()
        for key, entries in conditions(results.get("needle") or []).items()
    ]
    if not rows:
        return []
    gaps = sorted({e["gap"] for _, _, entries in rows for e in entries})
    columns = ["model", "variant", "depth", "mode"] + [gap_header(g, train_len) for g in gaps]
    exact_rows, digit_rows = [], []
    for name, (mode, variant, depth), entries in rows:
        by_gap = {e["gap"]: e for e in entries}
        lead = [name, variant, depth_label(depth), MODE_TITLE.get(mode, mode)]
        exact_rows.append(lead + [percent(by_gap[g].get("exact_acc")) if g in by_gap else "" for g in gaps])
        digit_rows.append(lead + [percent(by_gap[g]["digit_acc"]) if g in by_gap else "" for g in gaps])
    trials = sorted({e["trials"] for _, _, entries in rows for e in entries})
    return [
        "## Induction needle: exact recall (% of trials) by gap",
        markdown_table(columns, exact_rows),
        "## Induction needle: per-token accuracy (%) by gap",
        markdown_table(columns, digit_rows),
        f"Trials per gap and condition: {', '.join(map(str, trials))}.",
    ]


def _length_table(results_by_name: dict[str, dict]) -> list[str]:
    curves = {n: r["length_curve"] for n, r in results_by_name.items() if r.get("length_curve")}
    if not curves:
        return []
    lengths = sorted({n for c in curves.values() for n in c["lengths"]})
    table = []
    for name, curve in curves.items():
        nll = dict(zip(curve["lengths"], curve["nll"]))
        table.append([name, str(curve["documents"])] + [f"{nll[n]:.4f}" if n in nll else "" for n in lengths])
    return [
        "## Length curve: mean NLL per token (nats) by prefix length",
        markdown_table(["model", "documents"] + [size_label(n) for n in lengths], table),
    ]


def comparison_markdown(results_by_name: dict[str, dict]) -> str:
    """The comparison's results.md: where each model came from, then its numbers by gap and length."""
    train_len = _train_len(results_by_name)
    sources = [
        f"- {name}: `{r.get('checkpoint')}`, step {r.get('step')}, trained at seq_len {r.get('train_seq_len')}"
        for name, r in results_by_name.items()
    ]
    parts = ["# Evaluation comparison", "\n".join(sources), "Accuracies in percent."]
    parts += _needle_tables(results_by_name, train_len) + _length_table(results_by_name)
    return "\n\n".join(parts) + "\n"


def write_comparison(results_by_name: dict[str, dict], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / RESULTS_MD]
    write_text_atomic(written[0], comparison_markdown(results_by_name))
    if any(r.get("needle") for r in results_by_name.values()):
        written.append(plot_needle(results_by_name, out / NEEDLE_PNG))
    if any(r.get("length_curve") for r in results_by_name.values()):
        written.append(plot_length_curves(results_by_name, out / LENGTH_PNG))
    return written

