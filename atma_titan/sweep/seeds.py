"""A cell's numbers over its training seeds: mean and spread per measure, and a mean results dict
(results.json's schema) for the comparison plots, so that each cell is one line.

The spread is the range (min-max) over the seeds, with n; the CSV adds the sample standard deviation.
Torch-free.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable

NEEDLE_MEANS = ("digit_acc", "exact_acc", "ce", "control_ce")


@dataclass(frozen=True)
class Spread:
    mean: float
    low: float
    high: float
    n: int
    std: float | None  # the sample standard deviation (n - 1); None for a single value

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread | None:
        values = [float(v) for v in values]
        if not values:
            return None
        std = statistics.stdev(values) if len(values) > 1 else None
        return cls(statistics.fmean(values), min(values), max(values), len(values), std)

    def text(self, spec: str, n_expected: int) -> str:
        """'87.5 (80.0-95.0)' ('87.5' for one value), with ', n=2' when fewer seeds than the cell's
        evaluated ones measured it."""
        mean = spec.format(self.mean)
        if self.n == 1:
            return mean if n_expected == 1 else f"{mean} (n=1)"
        n = f", n={self.n}" if self.n != n_expected else ""
        return f"{mean} ({spec.format(self.low)}-{spec.format(self.high)}{n})"


def _mean(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.fmean(values) if values else None


def mean_results(name: str, runs: list[dict]) -> dict:
    """The mean over runs' results.json dicts, in the same schema (for the eval report's plots):
    needle rows averaged per (mode, variant, depth, gap) with their min / max and the seeds counted
    in "seeds", the length curve averaged at each length; other keys from the first run."""
    if len(runs) == 1:
        return {**runs[0], "name": name}
    rows: dict[tuple, list[dict]] = {}
    for results in runs:
        for row in results.get("needle") or []:
            key = (row.get("mode"), row.get("variant"), row.get("depth"), row.get("gap"))
            rows.setdefault(key, []).append(row)
    needle = []
    for group in rows.values():
        row = {**group[0], "trials": sum(int(r.get("trials") or 0) for r in group), "seeds": len(group)}
        for field in NEEDLE_MEANS:
            row[field] = _mean([r.get(field) for r in group])
        for field in ("digit_acc", "exact_acc"):
            values = [r[field] for r in group if isinstance(r.get(field), (int, float))]
            row[f"{field}_min"], row[f"{field}_max"] = (min(values), max(values)) if values else (None, None)
        needle.append(row)
    curve = _mean_curve([r.get("length_curve") for r in runs])
    return {**runs[0], "name": name, "needle": needle, "length_curve": curve, "seeds": len(runs)}


def _mean_curve(curves: list[dict | None]) -> dict | None:
    by_length: dict[int, list[float]] = {}
    present = [c for c in curves if c and c.get("lengths")]
    for curve in present:
        for n, v in zip(curve["lengths"], curve.get("nll") or []):
            by_length.setdefault(int(n), []).append(float(v))
    if not by_length:
        return None
    lengths = sorted(by_length)
    return {
        **present[0],
        "lengths": lengths,
        "nll": [statistics.fmean(by_length[n]) for n in lengths],
        "seeds": len(present),
    }
