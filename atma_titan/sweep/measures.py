"""The numbers of one run's eval/results.json (its schema: atma_titan.eval.report), keyed by what
they measure, in the units of the sweep's tables: recall in percent, NLL in nats per token.

Torch-free, like the rest of `list` / `collect`.
"""

from __future__ import annotations

from dataclasses import dataclass

from atma_titan.eval.common import size_label

EXACT, DIGIT, NLL = "exact", "digit", "nll"
TEACHER_FORCED = "teacher_forced"  # a needle row without "mode" (written before it existed) is teacher-forced
METRIC_TITLES = {
    EXACT: "Exact 5/5 recall (%)",
    DIGIT: "Per-digit accuracy (%)",
    NLL: "Length curve: mean NLL per token (nats)",
}
METRIC_ORDER = {EXACT: 0, DIGIT: 1, NLL: 2}


@dataclass(frozen=True)
class Measure:
    """One number of a run: a needle metric at (mode, variant, depth, gap), or the NLL at a length."""

    metric: str  # exact | digit | nll
    x: int  # the gap (needle) or the prefix length (nll)
    variant: str = ""  # access | passkey | records ("" for nll)
    depth: float = 0.0
    mode: str = ""  # teacher_forced | generated ("" for nll)

    @property
    def condition(self) -> tuple[str, str, float, str]:
        """What one table of results.md holds: everything but the gap / length."""
        return self.metric, self.variant, self.depth, self.mode

    def sort_key(self) -> tuple:
        first = (METRIC_ORDER[self.metric], self.mode != TEACHER_FORCED, self.mode, self.variant != "access")
        return (*first, self.variant, self.depth, self.x)


def sort_measures(measures) -> list[Measure]:
    return sorted(set(measures), key=Measure.sort_key)


def needle_measures(results: dict) -> dict[Measure, float]:
    """Exact and per-digit recall (%) per (mode, variant, depth, gap); rows of one condition that occur
    twice are merged, weighted by their trials. Rows missing a field are left out."""
    sums: dict[Measure, list[float]] = {}
    for row in results.get("needle") or []:
        try:
            common = dict(
                x=int(row["gap"]),
                variant=str(row.get("variant", "access")),
                depth=float(row.get("depth") or 0.0),
                mode=str(row.get("mode") or TEACHER_FORCED),
            )
            weight = float(row.get("trials") or 1)
            values = {EXACT: 100 * float(row["exact_acc"]), DIGIT: 100 * float(row["digit_acc"])}
        except (KeyError, TypeError, ValueError):
            continue
        for metric, value in values.items():
            total = sums.setdefault(Measure(metric, **common), [0.0, 0.0])
            total[0] += value * weight
            total[1] += weight
    return {m: s / w for m, (s, w) in sums.items() if w > 0}


def length_nll(results: dict) -> dict[int, float]:
    curve = results.get("length_curve") or {}
    try:
        return {int(n): float(v) for n, v in zip(curve.get("lengths") or [], curve.get("nll") or [])}
    except (TypeError, ValueError):
        return {}


def run_measures(results: dict | None) -> dict[Measure, float]:
    """Every number of one results.json (none for a run without one)."""
    if not results:
        return {}
    measures = needle_measures(results)
    measures.update({Measure(NLL, n): v for n, v in length_nll(results).items()})
    return measures


def needle_trials(results: dict | None) -> set[int]:
    """The trials per (gap, depth) the run's needle rows were measured with."""
    out = set()
    for row in (results or {}).get("needle") or []:
        try:
            out.add(int(row["trials"]))
        except (KeyError, TypeError, ValueError):
            pass
    return out


def needle_accuracy(results: dict) -> dict[tuple[str, int], float]:
    """(variant, gap) -> per-digit accuracy (a fraction), the trial-weighted mean over depths and modes."""
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


# ---------------------------------------------------------------------------------------------
# Labels: a table's title, a CSV column


def depth_label(depth: float) -> str:
    return "depth 0 (before the haystack)" if depth == 0 else f"depth {depth:.0%}"


def condition_title(condition: tuple[str, str, float, str]) -> str:
    metric, variant, depth, mode = condition
    if metric == NLL:
        return METRIC_TITLES[NLL]
    how = "teacher-forced" if mode == TEACHER_FORCED else mode
    return f"{METRIC_TITLES[metric]}: {variant}, {depth_label(depth)}, {how}"


def x_label(measure: Measure) -> str:
    return size_label(measure.x)


def csv_column(measure: Measure, many_depths: bool, many_modes: bool) -> str:
    """'exact_pct_records@4096' (with '_depth0.5' / '_generated' only where the sweep has several)."""
    if measure.metric == NLL:
        return f"nll@{measure.x}"
    name = f"{measure.metric}_pct_{measure.variant}@{measure.x}"
    if many_depths:
        name += f"_depth{measure.depth:g}"
    if many_modes:
        name += f"_{measure.mode}"
    return name
