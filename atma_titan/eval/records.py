"""The needle in the built-in synthetic language: recall a record's value across a gap.

A model trained on the synthetic source has never seen English, so the text needle says nothing
about it. Its own induction task is the same test: `EOT, MARK key value, <gap filler>, MARK key`
-> predict `value` (SyntheticSource.recall_probe), scored like the text needle: per-token greedy
accuracy, all-tokens-right accuracy, mean CE, and the CE of the control without the first record.
With `generate=True` (the eval command's --generate) the model instead writes the value itself,
greedily and free-running after the query's `MARK key`, and every value token is scored (no CE, no
control), as in `atma_titan.eval.needle`. The rows use the results.json needle schema with variant
"records".
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from atma_titan.data.synthetic import SyntheticSource
from atma_titan.eval.needle import GENERATED, NeedleResult, generated_scores, score_batch

PROBE_INDEX = 1 << 40  # probes far from the windows any run trains on


def _score(model, probes, device) -> tuple[np.ndarray, np.ndarray]:
    tokens = torch.from_numpy(np.stack([t for t, _ in probes]))
    positions = torch.from_numpy(np.stack([p for _, p in probes]))
    pred, ce = score_batch(model, tokens[:, :-1], positions - 1, tokens.gather(1, positions), device=device)
    return (pred == tokens.gather(1, positions)).numpy(), ce.numpy()


def _probe_indices(seed: int, trials: int) -> list[int]:
    return [PROBE_INDEX + seed * 1_000_003 + i for i in range(trials)]


def _generated(model: nn.Module, source: SyntheticSource, gap: int, trials: int, seed: int, batch_tokens: int):
    probes = [source.recall_probe(i, gap) for i in _probe_indices(seed, trials)]
    value_at = [int(positions[0]) for _, positions in probes]  # the value ends the probe
    hits, exact = generated_scores(
        model, [t[:v] for (t, _), v in zip(probes, value_at)], [t[v:] for (t, _), v in zip(probes, value_at)],
        np.arange(source.value_len), batch_tokens,
    )  # fmt: skip
    return NeedleResult(
        "records", gap, 0.0, trials, float(hits.mean()), float(exact.mean()), None, None, mode=GENERATED
    )


def evaluate_records(
    model: nn.Module,
    source: SyntheticSource,
    gap: int,
    trials: int,
    *,
    seed: int = 0,
    batch_tokens: int = 1 << 17,
    device: torch.device | None = None,
    generate: bool = False,
) -> NeedleResult:
    """One gap: teacher-forced with the control, or (generate) the value generated free-running."""
    if generate:
        return _generated(model, source, gap, trials, seed, batch_tokens)
    per_batch = max(1, batch_tokens // (gap + 2 * source.record_len + 1))
    indices = _probe_indices(seed, trials)
    hits, ces, control_ces = [], [], []
    for start in range(0, trials, per_batch):
        batch = indices[start : start + per_batch]
        hit, ce = _score(model, [source.recall_probe(i, gap) for i in batch], device)
        _, control = _score(model, [source.recall_probe(i, gap, with_needle=False) for i in batch], device)
        hits.append(hit), ces.append(ce), control_ces.append(control)
    hit = np.concatenate(hits)
    return NeedleResult(
        "records",
        gap,
        0.0,
        trials,
        float(hit.mean()),
        float(hit.all(axis=1).mean()),
        float(np.concatenate(ces).mean()),
        float(np.concatenate(control_ces).mean()),
    )


def run_records(
    model, source, *, gaps, trials, seed=0, batch_tokens=1 << 17, device=None, progress=print, generate=False
):
    results = []
    for gap in gaps:
        results.append(
            evaluate_records(
                model, source, gap, trials, seed=seed, batch_tokens=batch_tokens, device=device, generate=generate
            )
        )
        progress(results[-1].line())
    return results
