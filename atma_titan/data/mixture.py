"""A mixture of token sources: which source each window of the global stream comes from, stage by stage.

A mixture config names several sources (`[[data.sources]]`, each a kind, a path and a weight) and,
optionally, stages (`[[data.stages]]`) that set new weights from a step on. Window i of the global
stream (the stream `loader` splits across ranks) comes from source

    source(i) = the s with cum(w)[s-1] <= u(i) < cum(w)[s],  u(i) = splitmix64(key(seed) ^ i) / 2^64

for the weights w of the stage that trains window i's step (normalised). So the sequence of sources is a
function of (seed, i, weights) alone: the same at any world size, any number of loader workers and after
any resume. Inside a source, windows are taken in order: a source's k-th window is the k-th window of the
global stream drawn from it, so a random-access source (synthetic, `.bin`) reads its own window k, and a
streamed one (text, HF) the next window its part packs. The count of each source's windows before window
i (`MixtureSchedule.counts_before`) is recomputed from the draws (a vectorised hash, ~10 ns a window), so
a run resumes at any world size from the one global window count.

This module is the config's form and the arithmetic; `mixture_batches` feeds training from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from atma_titan.utils.errors import ConfigError

__all__ = ["KINDS", "MixtureSchedule", "MixtureSpec", "SourceSpec", "Stage", "parse_mixture", "uniform_draws"]

KINDS = ("synthetic", "bin", "text", "hf")
MAIN_STAGE = "main"  # the stage of the sources' own weights, from step 1 until the first [[data.stages]]

# A source table's keys and their types: the kind and path of one source, as `[data]` names them for a
# single source. The run's tokenizer (data.tokenizer) is shared: every window feeds one embedding table.
SOURCE_KEYS = {
    "name": str,
    "source": str,
    "path": str,
    "val_path": str,
    "weight": float,
    "hf_config": str,
    "hf_split": str,
    "text_field": str,
    "seed": int,
}
STAGE_KEYS = {"name": str, "start_step": int, "start": float, "weights": dict}


@dataclass(frozen=True)
class SourceSpec:
    """One source of a mixture: what `[data]` says of a single source, and its weight in the main stage."""

    name: str
    source: str
    path: str = ""
    val_path: str = ""
    weight: float = 1.0
    hf_config: str = ""
    hf_split: str = "train"
    text_field: str = "text"
    seed: int = 1234  # synthetic: its language's seed


@dataclass(frozen=True)
class Stage:
    """From optimizer step `start_step` (counted from 1) on, windows are drawn with these weights."""

    name: str
    start_step: int
    weights: tuple[float, ...]  # one per source, in the sources' order; not normalised

    @property
    def shares(self) -> np.ndarray:
        w = np.asarray(self.weights, dtype=np.float64)
        return w / w.sum()


@dataclass(frozen=True)
class MixtureSpec:
    sources: tuple[SourceSpec, ...]
    stages: tuple[Stage, ...]  # the main stage first, then by start_step
    seed: int

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def stage_at(self, step: int) -> Stage:
        """The stage that trains optimizer step `step` (from 1)."""
        current = self.stages[0]
        for stage in self.stages[1:]:
            if stage.start_step <= step:
                current = stage
        return current

    def stage_named(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)


def _need(ok: bool, origin: str, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{origin}: '{key}' = {value!r} is invalid; allowed: {allowed}.")


def _typed(table: dict, keys: dict, origin: str, where: str) -> dict:
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise ConfigError(f"{origin}: unknown key '{where}.{unknown[0]}'; allowed: {', '.join(keys)}.")
    out = {}
    for key, value in table.items():
        kind = keys[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        _need(ok, origin, f"{where}.{key}", value, f"a {'number' if kind is float else kind.__name__}")
        out[key] = value
    return out


def _weight(value, origin: str, key: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    _need(ok, origin, key, value, "a finite number >= 0")
    return float(value)


def _parse_sources(tables: list, origin: str) -> tuple[SourceSpec, ...]:
    sources: list[SourceSpec] = []
    for i, table in enumerate(tables):
        where = f"data.sources[{i}]"
        _need(
            isinstance(table, dict), origin, where, table, "a table ([[data.sources]] with name, source, path, weight)"
        )
        fields = _typed(table, SOURCE_KEYS, origin, where)
        for key in ("name", "source"):
            _need(key in fields, origin, f"{where}.{key}", None, "a value (every source has a name and a kind)")
        name = fields["name"]
        _need(
            name.replace("_", "").replace("-", "").isalnum(), origin, f"{where}.name", name, "letters, digits, - and _"
        )
        _need(name not in [s.name for s in sources], origin, f"{where}.name", name, "a name no other source has")
        _need(fields["source"] in KINDS, origin, f"{where}.source", fields["source"], " | ".join(KINDS))
        _need(
            fields["source"] == "synthetic" or bool(fields.get("path")),
            origin, f"{where}.path", fields.get("path", ""), f"a path or URL for a '{fields['source']}' source",
        )  # fmt: skip
        fields["weight"] = _weight(fields.get("weight", 1.0), origin, f"{where}.weight")
        sources.append(SourceSpec(**fields))
    return tuple(sources)


def _parse_stages(tables: list, sources: tuple[SourceSpec, ...], steps: int, origin: str) -> tuple[Stage, ...]:
    names = [s.name for s in sources]
    stages = [Stage(MAIN_STAGE, 1, tuple(s.weight for s in sources))]
    for i, table in enumerate(tables):
        where = f"data.stages[{i}]"
        _need(isinstance(table, dict), origin, where, table, "a table ([[data.stages]] with name, start_step, weights)")
        fields = _typed(table, STAGE_KEYS, origin, where)
        name = fields.get("name", f"stage{i + 1}")
        _need(name not in [s.name for s in stages], origin, f"{where}.name", name, "a name no other stage has")
        _need(
            ("start_step" in fields) != ("start" in fields),
            origin, where, table, "exactly one of start_step (a step) or start (a fraction of training.steps)",
        )  # fmt: skip
        if "start" in fields:
            fraction = fields["start"]
            _need(0 < fraction < 1, origin, f"{where}.start", fraction, "a fraction of training.steps in (0, 1)")
            start = int(fraction * steps) + 1
        else:
            start = fields["start_step"]
        key = f"{where}.{'start' if 'start' in fields else 'start_step'}"
        shown = fields.get("start", start)
        _need(
            start > stages[-1].start_step,
            origin,
            key,
            shown,
            f"after the previous stage (step {stages[-1].start_step})",
        )
        _need(start <= steps, origin, key, shown, f"a step the run reaches (training.steps = {steps})")
        weights = fields.get("weights")
        _need(
            weights is not None and len(weights) > 0, origin, f"{where}.weights", weights, "a table {source = weight}"
        )
        for source in weights:
            _need(source in names, origin, f"{where}.weights.{source}", weights[source], f"a source of {names}")
        w = tuple(_weight(weights.get(n, 0.0), origin, f"{where}.weights.{n}") for n in names)
        _need(sum(w) > 0, origin, f"{where}.weights", weights, "at least one weight > 0")
        stages.append(Stage(name, start, w))
    return tuple(stages)


def parse_mixture(cfg_data, steps: int, origin: str = "config") -> MixtureSpec | None:
    """The mixture `[data]` describes, checked (ConfigError naming `origin`, the key and the value), or None
    for a single source (`data.source` / `data.path`)."""
    if not cfg_data.sources:
        _need(not cfg_data.stages, origin, "data.stages", cfg_data.stages, "empty without [[data.sources]]")
        return None
    sources = _parse_sources(cfg_data.sources, origin)
    stages = _parse_stages(cfg_data.stages, sources, steps, origin)
    _need(
        sum(stages[0].weights) > 0,
        origin, "data.sources[].weight", [s.weight for s in sources], "at least one weight > 0",
    )  # fmt: skip
    return MixtureSpec(sources, stages, int(cfg_data.seed))


# ---------------------------------------------------------------------------------------------------------
# The draw


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 (wrapping arithmetic): a fast, well-mixed counter hash."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _key(seed: int) -> np.uint64:
    return _splitmix64(np.array([seed & (2**64 - 1)], dtype=np.uint64))[0]


def uniform_draws(seed: int, first: int, count: int, key: np.uint64 | None = None) -> np.ndarray:
    """u(i) in [0, 1) for windows first .. first + count - 1: float64 of 53 hashed bits each."""
    z = _splitmix64(np.arange(first, first + count, dtype=np.uint64) ^ (_key(seed) if key is None else key))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


class MixtureSchedule:
    """Window -> source, and each source's window count before a window, for a global batch of `global_batch`
    windows a step (step s trains windows [(s-1) G, s G))."""

    CHUNK = 1 << 20  # windows drawn at a time when counting from the start
    BLOCK = 1 << 14  # windows drawn at a time while training: numpy's per-call cost spread over many windows

    def __init__(self, spec: MixtureSpec, global_batch: int):
        self.spec, self.global_batch = spec, global_batch
        self.key = _key(spec.seed)
        self.cumulative = [np.cumsum(stage.shares) for stage in spec.stages]
        self.starts = [(stage.start_step - 1) * global_batch for stage in spec.stages]  # first window of each
        self._counted = (0, np.zeros(len(spec.sources), dtype=np.int64))  # (window, counts before it)
        self._block = (0, np.empty(0, dtype=np.int64))  # (first window, sources) drawn last

    @property
    def num_sources(self) -> int:
        return len(self.spec.sources)

    def sources(self, first: int, count: int) -> np.ndarray:
        """The source index (int64) of windows first .. first + count - 1."""
        start, block = self._block
        if not start <= first <= first + count <= start + len(block):
            start = first - first % self.BLOCK
            block = self.draw(start, max(self.BLOCK, first + count - start))
            self._block = (start, block)
        return block[first - start : first - start + count].copy()  # a copy: the block is reused

    def draw(self, first: int, count: int) -> np.ndarray:
        """sources(), computed: the hash, then each stage's cumulative weights."""
        u = uniform_draws(self.spec.seed, first, count, self.key)
        out = np.empty(count, dtype=np.int64)
        windows = np.arange(first, first + count)
        for k, cumulative in enumerate(self.cumulative):
            end = self.starts[k + 1] if k + 1 < len(self.starts) else None
            inside = (windows >= self.starts[k]) & (windows < end if end is not None else True)
            # side="right": u == cum[s] belongs to s + 1; min(): cum[-1] may round below 1.
            out[inside] = np.minimum(np.searchsorted(cumulative, u[inside], side="right"), self.num_sources - 1)
        return out

    def anchor(self, window: int, counts) -> None:
        """Count on from `counts` at `window`: a resumed run's per-source windows, as its checkpoint saved them, so each
        source continues where it stopped even when the stages moved (a `start` fraction of a longer run)."""
        self._counted = (window, np.asarray(counts, dtype=np.int64).copy())

    def counts_before(self, window: int) -> np.ndarray:
        """How many of windows 0 .. window - 1 each source gave (from the last count when moving forward)."""
        at, counts = self._counted
        if window < at:
            at, counts = 0, np.zeros(self.num_sources, dtype=np.int64)
        counts = counts.copy()
        while at < window:
            n = min(self.CHUNK, window - at)
            counts += np.bincount(self.draw(at, n), minlength=self.num_sources)
            at += n
        self._counted = (window, counts)
        return counts.copy()

    def local_indices(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source) of windows first .. first + count - 1; afterwards the count stands
        at first + count, so consecutive calls (a step after a step) draw each window once."""
        sources = self.sources(first, count)
        counts = self.counts_before(first)
        # Each window's rank among the earlier windows of its source in this range: a running count per source.
        running = np.cumsum(sources[:, None] == np.arange(self.num_sources), axis=0)
        local = counts[sources] + running[np.arange(count), sources] - 1
        self._counted = (first + count, counts + running[-1])
        return sources, local


# ---------------------------------------------------------------------------------------------------------
# The plan a dry run prints


def stage_windows(schedule: MixtureSchedule, steps: int) -> list[tuple[Stage, int, int, np.ndarray]]:
    """Per stage: (stage, first step, last step, windows drawn from each source), counted from the draws."""
    spec, g = schedule.spec, schedule.global_batch
    out = []
    for k, stage in enumerate(spec.stages):
        last = spec.stages[k + 1].start_step - 1 if k + 1 < len(spec.stages) else steps
        before, after = schedule.counts_before((stage.start_step - 1) * g), schedule.counts_before(last * g)
        out.append((stage, stage.start_step, last, after - before))
    return out


def describe_plan(schedule: MixtureSchedule, steps: int, seq_len: int, windows_per_pass: list[int | None]) -> list[str]:
    """The mixture's plan as lines: per stage and source, tokens, share and passes over the source.

    `windows_per_pass`: each source's windows of `seq_len + 1` tokens in one pass (None: unknown or unbounded)."""
    names = schedule.spec.names
    width = max(len(n) for n in names)
    lines = []
    total = np.zeros(len(names), dtype=np.int64)
    for stage, first, last, windows in stage_windows(schedule, steps):
        total += windows
        tokens = windows * seq_len
        lines.append(f"stage {stage.name}: steps {first}..{last}, {int(tokens.sum()):,} tokens")
        for name, n, share in zip(names, tokens, stage.shares):
            realised = n / max(1, tokens.sum())
            lines.append(f"  {name:<{width}}  {int(n):>15,} tokens  {realised:6.1%} (weight {share:.1%})")
    lines.append(f"whole run: {int(total.sum()) * seq_len:,} tokens")
    for name, n, per_pass in zip(names, total, windows_per_pass):
        if per_pass is None:
            passes = "passes unknown (streamed)"
        else:
            passes = "never repeats (generated)" if per_pass == 0 else f"{n / per_pass:.3f} passes over the source"
        lines.append(f"  {name:<{width}}  {int(n) * seq_len:>15,} tokens  {passes}")
    return lines
