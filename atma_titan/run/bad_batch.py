"""The record of a bad step: what it trained on and what its gradients looked like, for inspection and reproduction.

On a non-finite or spiking step (run/spikes.py) the trainer writes, while the step's gradients still exist,

    <dump_folder>/bad_batches/step-000123/
        summary.json          rank 0: the step, why it is bad (loss, gradient norm, their medians and
                              z-scores), the batch's layout, the largest gradient norms by parameter, and
                              how to roll the run back past it
        rank-00000.npz ...    each rank: `tokens` (windows x (seq_len + 1), int32: inputs and the last label),
                              `micro_batch` (each window's micro-batch), `windows` (its index in the global
                              stream, -1 for a streamed text source), `sources` (its mixture source, -1
                              without one) and `losses` (each micro-batch's share of the step's loss)

A run keeps at most `spikes.records` such folders (the first ones: a run that keeps spiking after them only
logs), so the folder stays small however long the run. `python -c "import numpy; print(numpy.load(
'.../rank-00000.npz')['tokens'])"` reads one back; the window indices say which `data.skip` to roll back with.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from atma_titan.utils.atomic import write_json_atomic

__all__ = ["BadBatchRecorder", "TOP_PARAMETERS"]

TOP_PARAMETERS = 20  # parameters listed by gradient norm in summary.json


class BadBatchRecorder:
    """Holds the current step's micro-batches (references to the loader's CPU tensors, no copies) and losses
    (device scalars, read only for a record), and writes a record on request."""

    def __init__(self, dump_folder: Path, rank: int, limit: int):
        self.folder, self.rank, self.limit = Path(dump_folder) / "bad_batches", rank, limit
        # Counted once, the same on every rank: records of earlier runs of this folder count against the limit.
        self.written = len(list(self.folder.glob("step-*"))) if self.folder.is_dir() else 0
        self.batches: list[tuple] = []
        self.losses: list[torch.Tensor] = []

    @property
    def full(self) -> bool:
        return self.written >= self.limit

    def start_step(self) -> None:
        self.batches, self.losses = [], []

    def add(self, inputs: torch.Tensor, labels: torch.Tensor, sources: torch.Tensor | None, loss: torch.Tensor) -> None:
        if self.limit:
            self.batches.append((inputs, labels, sources))
            self.losses.append(loss.detach())

    def write(self, step: int, summary: dict, windows: np.ndarray | None) -> Path:
        """This rank's file, and rank 0's summary.json; `windows`: this rank's global window indices in order."""
        folder = self.folder / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        tokens = np.concatenate([torch.cat([i, lab[:, -1:]], dim=1).numpy() for i, lab, _ in self.batches])
        sizes = [len(i) for i, _, _ in self.batches]
        sources = [s.numpy() if s is not None else np.full(len(i), -1) for i, _, s in self.batches]
        np.savez_compressed(
            folder / f"rank-{self.rank:05d}.npz",
            tokens=tokens.astype(np.int32),
            micro_batch=np.repeat(np.arange(len(sizes)), sizes),
            windows=np.full(len(tokens), -1) if windows is None else np.asarray(windows),
            sources=np.concatenate(sources),
            losses=torch.stack(self.losses).double().cpu().numpy(),
        )
        if self.rank == 0:
            write_json_atomic(folder / "summary.json", summary)
        self.written += 1
        return folder
