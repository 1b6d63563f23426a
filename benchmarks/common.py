"""What the benchmark scripts share: where a result is written, and how a GPU time is taken.

A script under benchmarks/<area>/ puts the repository on sys.path first (so `atma_titan` and this module
import without an install) and writes its JSON to benchmarks/results/<what>-<device>-<date>.json
(`result_path`). docs/performance.md cites that file; a newer measurement replaces it (`git rm` the old one).
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REPEATS = 20


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def device_tag() -> str:
    """The GPU's short name ("NVIDIA H200" -> "h200"), or "cpu"."""
    return device_name().split()[-1].lower()


def result_path(what: str, out: str | Path | None = None, device: str | None = None, tag: str | None = None) -> Path:
    """Where `what`'s result goes: `out` itself when it names a .json file, else, in `out` (default
    benchmarks/results/), <what>-<device>-<today>.json (device: device_tag() unless given), or <what>-<tag>.json
    when a tag is given."""
    out = Path(out) if out is not None else RESULTS
    if out.suffix == ".json":
        return out
    return out / f"{what}-{tag or f'{device or device_tag()}-{datetime.date.today().isoformat()}'}.json"


def write_json(path: Path, result: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return path


def median_ms(fn: Callable[[], object], repeats: int = REPEATS, warmup: int = 3) -> float:
    """The median of `repeats` CUDA-event timings of fn() after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def do_bench_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100, grad_to_none=None) -> float:
    """triton.testing.do_bench's median in ms (warm-up and autotuning excluded; `rep` and `warmup` in ms)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


# ---------------------------------------------------------------------------------------------
# Document lengths of packed data (the document-mask benchmarks)

MEAN_1K = 1024.0
# FineWeb-Edu-like: log-normal in GPT-2 tokens with median 600 and sigma 1.0 (mean 600 e^0.5 ~ 989). An
# assumed fit to the shape of its heavy tail (many short pages, a few very long ones), not measured here.
FINEWEB_MEDIAN, FINEWEB_SIGMA = 600.0, 1.0


def _exponential(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float64).exponential_(1.0 / MEAN_1K, generator=gen)


def _log_normal(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float64).log_normal_(math.log(FINEWEB_MEDIAN), FINEWEB_SIGMA, generator=gen)


SAMPLERS: dict[str, Callable[[int, torch.Generator], torch.Tensor] | None] = {
    "one": None,  # one document a window
    "1k": _exponential,
    "fineweb": _log_normal,
}


def document_lengths(kind: str, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """int64 lengths (each >= 1) of documents drawn from `kind` until they hold at least `tokens` tokens."""
    sample = SAMPLERS[kind]
    drawn, total = [], 0
    while total < tokens:
        lengths = sample(max(tokens // 256, 64), gen).round().clamp_(min=1).long()
        drawn.append(lengths)
        total += int(lengths.sum())
    return torch.cat(drawn)
