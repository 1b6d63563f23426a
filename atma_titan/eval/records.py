"""The needle in the built-in synthetic language: recall a record's value across a gap.

A model trained on the synthetic source has never seen English, so the text needle says nothing
about it. Its own induction task is the same test: `EOT, MARK key value, <gap filler>, MARK key`
-> predict `value` (SyntheticSource.recall_probe), scored like the text needle: per-token greedy
accuracy, all-tokens-right accuracy, mean CE, and the CE of the control without the first record.
With `generate=True` (the eval command's --generate) the model instead writes the value itself,
greedily and free-running after the query's `MARK key`, and every value token is scored (no CE, no
control), as in `atma_titan.eval.needle`. The rows use the results.json needle schema with variant
"records".

Depth (eval --depths), as for the text needle: at depth d the first record goes after the first
k = round(d * gap) of the gap's filler tokens instead of before them::

    EOT, filler[:k], MARK key value, filler[k:gap], MARK key value

so the sequence keeps its length, the query stays at the end, and the needle sits k tokens into the
haystack (gap - k filler tokens from the query). Depth 0 is the layout above. The filler, record
and control stand-in are SyntheticSource.recall_probe's, only rearranged: a trial carries the same
record and filler at every depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from atma_titan.data.synthetic import SyntheticSource
from atma_titan.eval.common import EvalInputError
from atma_titan.eval.needle import GENERATED, NeedleResult, generated_scores, score_batch

__all__ = ["PROBE_INDEX", "RecordsProbe", "evaluate_records", "records_probe", "run_records"]

PROBE_INDEX = 1 << 40  # probes far from the windows any run trains on


@dataclass(frozen=True)
class RecordsProbe:
    """One trial: `tokens` end with the query's value at `value_positions`; the needle record (or, in
    the control, its filler stand-in) starts at `needle_at`."""

    tokens: np.ndarray
    value_positions: np.ndarray
    needle_at: int


def records_probe(
    source: SyntheticSource, index: int, gap: int, depth: float = 0.0, *, with_needle: bool = True
) -> RecordsProbe:
    """The probe of window `index` at `gap` with its first record at `depth` of the filler (module docstring)."""
    if not 0.0 <= depth < 1.0:
        raise EvalInputError(f"records needle depth must be in [0, 1), got {depth}")
    tokens, positions = source.recall_probe(index, gap, with_needle=with_needle)
    record_len = source.record_len
    first, filler = tokens[1 : 1 + record_len], tokens[1 + record_len : 1 + record_len + gap]
    k = int(round(depth * gap))
    placed = np.concatenate([tokens[:1], filler[:k], first, filler[k:], tokens[1 + record_len + gap :]])
    return RecordsProbe(placed.astype(np.int64), positions, 1 + k)


def _score(model, probes: list[RecordsProbe], device) -> tuple[np.ndarray, np.ndarray]:
    tokens = torch.from_numpy(np.stack([p.tokens for p in probes]))
    positions = torch.from_numpy(np.stack([p.value_positions for p in probes]))
    pred, ce = score_batch(model, tokens[:, :-1], positions - 1, tokens.gather(1, positions), device=device)
    return (pred == tokens.gather(1, positions)).numpy(), ce.numpy()


def _probe_indices(seed: int, trials: int) -> list[int]:
    return [PROBE_INDEX + seed * 1_000_003 + i for i in range(trials)]


def _generated(model: nn.Module, source: SyntheticSource, gap: int, depth: float, trials: int, seed: int,
               batch_tokens: int) -> NeedleResult:  # fmt: skip
    probes = [records_probe(source, i, gap, depth) for i in _probe_indices(seed, trials)]
    value_at = [int(p.value_positions[0]) for p in probes]  # the value ends the probe
    hits, exact = generated_scores(
        model, [p.tokens[:v] for p, v in zip(probes, value_at)], [p.tokens[v:] for p, v in zip(probes, value_at)],
        np.arange(source.value_len), batch_tokens,
    )  # fmt: skip
    return NeedleResult(
        "records", gap, float(depth), trials, float(hits.mean()), float(exact.mean()), None, None, mode=GENERATED
    )


def evaluate_records(
    model: nn.Module,
    source: SyntheticSource,
    gap: int,
    trials: int,
    *,
    depth: float = 0.0,
    seed: int = 0,
    batch_tokens: int = 1 << 17,
    device: torch.device | None = None,
    generate: bool = False,
    control: bool = True,
) -> NeedleResult:
    """One (gap, depth): teacher-forced with the control (unless not `control`), or (generate) the value
    generated free-running."""
    depth = float(depth or 0.0)
    if generate:
        return _generated(model, source, gap, depth, trials, seed, batch_tokens)
    per_batch = max(1, batch_tokens // (gap + 2 * source.record_len + 1))
    indices = _probe_indices(seed, trials)
    hits, ces, control_ces = [], [], []
    for start in range(0, trials, per_batch):
        batch = indices[start : start + per_batch]
        hit, ce = _score(model, [records_probe(source, i, gap, depth) for i in batch], device)
        hits.append(hit), ces.append(ce)
        if control:
            without = [records_probe(source, i, gap, depth, with_needle=False) for i in batch]
            control_ces.append(_score(model, without, device)[1])
    hit = np.concatenate(hits)
    return NeedleResult(
        "records",
        gap,
        depth,
        trials,
        float(hit.mean()),
        float(hit.all(axis=1).mean()),
        float(np.concatenate(ces).mean()),
        float(np.concatenate(control_ces).mean()) if control else None,
    )


def run_records(
    model, source, *, gaps, depths=(0.0,), trials, seed=0, batch_tokens=1 << 17, device=None, progress=print,
    generate=False, control=True,
) -> list[NeedleResult]:  # fmt: skip
    """Every (depth, gap) condition, gaps innermost (as `run_needle`); one progress line per condition."""
    results = []
    for depth in depths:
        for gap in gaps:
            result = evaluate_records(
                model, source, gap, trials, depth=depth, seed=seed, batch_tokens=batch_tokens, device=device,
                generate=generate, control=control,
            )  # fmt: skip
            results.append(result)
            if progress:
                progress(results[-1].line())
    return results
