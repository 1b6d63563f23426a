"""Feeding training: one global stream of token windows, split by data-parallel rank.

The stream is a sequence of windows 0, 1, 2, ... of `seq_len + 1` tokens from a random-access
source. Optimizer step s consumes windows [s*G, (s+1)*G) (G = global batch in sequences); rank r
of W reads the r-th contiguous slice of G/W of them. The position in the stream is therefore one
number, "windows consumed", the same at any world size: a run resumes exactly where it stopped
even on a different number of ranks.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


class WindowSource(Protocol):
    def window(self, index: int, length: int) -> np.ndarray: ...


def check_split(global_batch: int, micro_batch: int, world_size: int) -> None:
    """Every rank's share of a step must be whole micro-batches (the trainer's BatchPlan ensures it)."""
    if global_batch % (world_size * micro_batch):
        raise ValueError(
            f"a global batch of {global_batch} sequences does not split into micro-batches of "
            f"{micro_batch} on {world_size} ranks"
        )


class RankBatches(IterableDataset):
    """This rank's share of the global window stream, as micro-batches of (inputs, labels), each (b, seq_len).

    With `recall_weight` != 1 (a source that plants recall records) a third tensor follows: per-label
    loss weights, `recall_weight` on the recall tokens and 1 elsewhere.

    With several loader workers, worker w builds this rank's micro-batches w, w + n, w + 2n, ...; the
    loader takes workers in turn, so the batches are the same for any number of workers. The state
    (`next_batch`) is per worker; the StatefulDataLoader gathers and restores it.
    """

    def __init__(
        self,
        source: WindowSource,
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        start_window: int = 0,
        recall_weight: float = 1.0,
        skips=None,
    ):
        """skips: a data.skips.StreamSkips, the stream's windows training leaves out (None: none)."""
        if recall_weight != 1.0 and not hasattr(source, "window_with_recall_mask"):
            raise ValueError(f"recall_weight needs a source with recall records, not {type(source).__name__}")
        check_split(global_batch, micro_batch, world_size)
        self.source, self.seq_len, self.micro_batch = source, seq_len, micro_batch
        self.global_batch, self.per_rank = global_batch, global_batch // world_size
        self.rank, self.start_window = rank, start_window
        self.recall_weight = recall_weight
        self.skips = skips
        self.next_batch: int | None = None  # None: start at this worker's first batch

    def global_index(self, sample: int) -> int:
        """Global window index of this rank's `sample`-th sample since `start_window` (past any skipped windows)."""
        step, within = divmod(sample, self.per_rank)
        position = self.start_window + step * self.global_batch + self.rank * self.per_rank + within
        return self.skips.stream_index(position) if self.skips else position

    def batch(self, b: int) -> tuple[torch.Tensor, ...]:
        first = b * self.micro_batch
        indices = [self.global_index(s) for s in range(first, first + self.micro_batch)]
        if self.recall_weight == 1.0:
            windows = [self.source.window(i, self.seq_len + 1) for i in indices]
            tokens = torch.from_numpy(np.stack(windows).astype(np.int64))
            return tokens[:, :-1], tokens[:, 1:]
        windows, masks = zip(*(self.source.window_with_recall_mask(i, self.seq_len + 1) for i in indices))
        tokens = torch.from_numpy(np.stack(windows).astype(np.int64))
        recall = torch.from_numpy(np.stack(masks)[:, 1:])  # aligned with the labels
        weights = torch.where(recall, self.recall_weight, 1.0).float()
        return tokens[:, :-1], tokens[:, 1:], weights

    def __iter__(self):
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        if self.next_batch is None:
            self.next_batch = worker
        while True:
            b = self.next_batch
            self.next_batch += n_workers
            yield self.batch(b)

    def state_dict(self) -> dict:
        return {"next_batch": self.next_batch, "start_window": self.start_window}

    def load_state_dict(self, state: dict) -> None:
        self.next_batch, self.start_window = state["next_batch"], state["start_window"]


def stateful_loader(dataset: IterableDataset, num_workers: int = 0, pin_memory: bool = False):
    """A torchdata StatefulDataLoader over a dataset that yields whole micro-batches."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(
        dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory, persistent_workers=num_workers > 0
    )


def build_dataloader(
    source: WindowSource,
    seq_len: int,
    global_batch: int,
    micro_batch: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    start_window: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    recall_weight: float = 1.0,
    skips=None,
):
    """This rank's micro-batches of a random-access source; its state_dict() resumes it exactly."""
    dataset = RankBatches(
        source, seq_len, global_batch, micro_batch, rank, world_size, start_window, recall_weight, skips
    )
    return stateful_loader(dataset, num_workers, pin_memory)
