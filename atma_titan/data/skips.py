"""Skipped data (`data.skip`, `data.skip_windows`): windows of the global stream that training jumps over.

A run rolled back past a loss spike (checkpoint.load_step) trains on without the batches that caused it:
`data.skip = [[120, 125]]` leaves out the windows steps 120..125 of the data stream would have trained
(step s's windows are [(s - 1) G, s G) for G windows a step), `data.skip_windows = [[a, b]]` windows a..b.
Both count in the stream's own numbering, so they mean the same windows at any world size, and the
trainer's position p (windows trained) maps to the stream's window

    stream(p) = p + the skipped windows at or before it,

for random-access sources and mixtures alike (a mixture draws each window's source from its stream index, so
the skipped windows' sources and contents are left out, not shifted). A streamed text or HF source has no
global window index: its skipped steps' micro-batches are read and dropped, so only `data.skip` (whole steps)
applies to it.

The ranges in force are in the checkpoint ("data_skip"): a resume may add or change ranges ahead of its
position, never behind it (that would change what the saved weights trained on).
"""

from __future__ import annotations

import json

import numpy as np

from atma_titan.utils.errors import ConfigError

__all__ = ["SkipState", "StreamSkips", "skip_pairs"]


class StreamSkips:
    """Merged, sorted half-open window ranges [a, b) of the stream that are skipped."""

    def __init__(self, ranges: list[tuple[int, int]] = ()):
        merged: list[list[int]] = []
        for a, b in sorted((int(a), int(b)) for a, b in ranges if b > a):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.ranges = [tuple(r) for r in merged]

    @classmethod
    def from_config(cls, cfg_data, global_batch: int) -> StreamSkips:
        steps = skip_pairs(cfg_data.skip, "data.skip", 1)
        windows = skip_pairs(cfg_data.skip_windows, "data.skip_windows", 0)
        return cls([((a - 1) * global_batch, b * global_batch) for a, b in steps] + [(a, b + 1) for a, b in windows])

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def stream_index(self, position):
        """The stream's index of the window trained at `position` (int or int array)."""
        index = np.asarray(position, dtype=np.int64).copy()
        for a, b in self.ranges:  # in order: each shift can move an index past the next range's start
            index += np.where(index >= a, b - a, 0)
        return int(index) if np.ndim(position) == 0 else index

    def stream_step(self, step: int, global_batch: int) -> int:
        """The data stream's step (its numbering, which data.skip uses) that trained step `step` reads."""
        return self.stream_index((step - 1) * global_batch) // global_batch + 1

    def before(self, index: int) -> list[tuple[int, int]]:
        """The ranges clipped to the windows before stream index `index`."""
        return [(a, min(b, index)) for a, b in self.ranges if a < index]

    def describe(self, global_batch: int) -> str:
        parts = []
        for a, b in self.ranges:
            if a % global_batch == 0 and b % global_batch == 0:
                parts.append(f"steps {a // global_batch + 1}..{b // global_batch}")
            else:
                parts.append(f"windows {a}..{b - 1}")
        return ", ".join(parts)


def skip_pairs(value, key: str, low: int) -> list[tuple[int, int]]:
    """`value` as (first, last) pairs, both >= `low` and first <= last: a TOML list of pairs, or the command line's
    flat list of numbers taken two by two; ConfigError naming `key` otherwise."""
    flat = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    pairs = [tuple(value[i : i + 2]) for i in range(0, len(value), 2)] if flat else [tuple(v) for v in value]
    for pair in pairs:
        ok = len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
        if not (ok and low <= pair[0] <= pair[1]):
            raise ConfigError(
                f"'{key}' = {value!r} is invalid; allowed: a list of [first, last] pairs of integers >= {low} with "
                "first <= last (e.g. [[120, 125]])."
            )
    return pairs


class SkipState:
    """The ranges in force, in the checkpoint (a DCP Stateful, "data_skip"). After a load, `check()` refuses this
    run's ranges where they differ from the saved ones behind the saved position."""

    def __init__(self, skips: StreamSkips):
        self.skips, self.saved = skips, None

    def state_dict(self) -> dict:
        return {"ranges": json.dumps(self.skips.ranges)}

    def load_state_dict(self, state: dict) -> None:
        self.saved = StreamSkips([tuple(r) for r in json.loads(state["ranges"])])

    def check(self, position: int) -> None:
        """`position`: the windows the loaded run had trained."""
        saved = self.saved or StreamSkips()
        behind = saved.stream_index(position)
        if saved.before(behind) != self.skips.before(behind):
            raise ConfigError(
                f"data.skip / data.skip_windows skip {self.skips.before(behind) or 'nothing'} before the checkpoint's "
                f"position (stream window {behind:,}), where the saved run skipped {saved.before(behind) or 'nothing'}:"
                " a resume may only skip data ahead of its position"
            )
