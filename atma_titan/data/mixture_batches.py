"""Feeding training from a mixture: this rank's micro-batches of the global window stream, each window from the
source the mixture draws for it (`mixture.MixtureSchedule`).

The global stream is split as for a single random-access source (`loader.RankBatches`): step s trains windows
[s G, (s + 1) G) of the stream, rank r of W the r-th contiguous slice of G / W, in micro-batches; with several
loader workers, worker w builds this rank's micro-batches w, w + n, ... A window drawn from a random-access
source (synthetic, `.bin`) is that source's own window k, k its count of earlier windows in the global
stream; one drawn from a streamed source (text, HF) is the next window that this part (rank x worker) packs
of that source (`packing.PartWindows`), so streamed sources split and resume as a single one does: exactly at
the same world size and workers, from each source's document cursor at another.

A micro-batch is (inputs, labels, sources): sources (b,) int64 is each row's source index, for the
per-source accounting (`mixture_accounting`).

State per worker: the next micro-batch, the stream position it counts from, and each streamed source's part
state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from atma_titan.data.loader import check_split, stateful_loader
from atma_titan.data.mixture import MixtureSchedule
from atma_titan.data.packing import PartWindows, check_part_state

__all__ = ["MixtureBatches", "Streamed", "build_mixture_dataloader"]


@dataclass
class Streamed:
    """A streamed source of a mixture: its documents, the tokenizer, and the stream plan its parts read under."""

    source: object  # documents.DocumentSource
    tokenizer: object
    plan: object  # stream_plan.StreamPlan


class MixtureBatches(IterableDataset):
    def __init__(
        self,
        schedule: MixtureSchedule,
        sources: list,  # per source: a random-access source (`window(i, length)`) or a Streamed
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        start_window: int = 0,
        names: list[str] | None = None,
        skips=None,
    ):
        check_split(global_batch, micro_batch, world_size)
        self.schedule, self.sources = schedule, sources
        self.names = names or [f"source{i}" for i in range(len(sources))]
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.global_batch, self.per_rank = global_batch, global_batch // world_size
        self.rank, self.world_size, self.start_window = rank, world_size, start_window
        self.skips = skips  # data.skips.StreamSkips: windows of the stream left out (None: none)
        self.next_batch: int | None = None  # None: this worker's first batch
        self.stream_states: dict[str, dict] = {}  # streamed source name -> its part state
        self._windows: dict[int, PartWindows] = {}  # the running iteration's part streams
        self._step: tuple | None = None  # (step, sources, local indices) of the step being read

    def step_windows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within it) of every window of a step (all ranks'), computed once a step."""
        if self._step is None or self._step[0] != step:
            first = self.start_window + step * self.global_batch
            if not self.skips:
                self._step = (step, *self.schedule.local_indices(first, self.global_batch))
            else:  # the step's stream windows, past the skipped ones: drawn over their span, the skipped left out
                stream = self.skips.stream_index(np.arange(first, first + self.global_batch))
                sources, local = self.schedule.local_indices(int(stream[0]), int(stream[-1] - stream[0]) + 1)
                self._step = (step, sources[stream - stream[0]], local[stream - stream[0]])
        return self._step[1], self._step[2]

    def batch(self, b: int, part: int, num_parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        step, within = divmod(b * self.micro_batch, self.per_rank)
        mine = slice(self.rank * self.per_rank + within, self.rank * self.per_rank + within + self.micro_batch)
        sources, local = (x[mine] for x in self.step_windows(step))
        # One tensor, the sources in its last column: inputs, labels and sources are views of one storage, which a
        # loader worker hands over once (a separate small tensor costs a shared-memory transfer of its own).
        packed = np.empty((self.micro_batch, self.seq_len + 2), dtype=np.int64)
        packed[:, -1] = sources
        for row, (s, k) in enumerate(zip(sources.tolist(), local.tolist())):
            source = self.sources[s]
            if isinstance(source, Streamed):
                packed[row, :-1] = self._part_windows(s, part, num_parts).next()
            else:
                packed[row, :-1] = source.window(k, self.seq_len + 1)
        tokens = torch.from_numpy(packed)
        return tokens[:, : self.seq_len], tokens[:, 1:-1], tokens[:, -1]

    def _part_windows(self, s: int, part: int, num_parts: int) -> PartWindows:
        if s not in self._windows:
            name, streamed = self.names[s], self.sources[s]
            state = self.stream_states.get(name)
            if state is not None:
                check_part_state(state, part, num_parts)
            self._windows[s] = PartWindows(
                streamed.source, streamed.tokenizer, self.seq_len + 1, part, num_parts, streamed.plan, state
            )
        return self._windows[s]

    def __iter__(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        part, num_parts = self.rank * num_workers + worker, self.world_size * num_workers
        if self.next_batch is None:
            self.next_batch = worker
        self._windows = {}
        while True:
            b = self.next_batch
            batch = self.batch(b, part, num_parts)
            self.next_batch += num_workers
            for s, windows in self._windows.items():
                self.stream_states[self.names[s]] = windows.state()
            yield batch

    def state_dict(self) -> dict:
        return {
            "next_batch": self.next_batch,
            "start_window": self.start_window,
            "streams": {name: dict(state) for name, state in self.stream_states.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.next_batch, self.start_window = state["next_batch"], state["start_window"]
        self.stream_states = {name: dict(s) for name, s in state.get("streams", {}).items()}
        self._windows, self._step = {}, None


def build_mixture_dataloader(
    schedule: MixtureSchedule,
    sources: list,
    seq_len: int,
    global_batch: int,
    micro_batch: int,
    *,
    names: list[str] | None = None,
    rank: int = 0,
    world_size: int = 1,
    start_window: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    skips=None,
):
    """This rank's micro-batches of a mixture; its state_dict() resumes it exactly."""
    dataset = MixtureBatches(
        schedule, sources, seq_len, global_batch, micro_batch, rank, world_size, start_window, names, skips
    )
    return stateful_loader(dataset, num_workers, pin_memory)
