"""One cell's folder and its status, read from the files the trainer and the eval command leave.

    <out>/cells/<name>/
      run/        the trainer's dump folder (its layout: atma_titan.run.folder)
      eval/       the eval command's --out: results.json, results.md, PNGs
      train.log   eval.log   FAILED

Torch-free: `list` and `collect` read cells without loading torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from atma_titan.eval.report import RESULTS_JSON
from atma_titan.run.folder import RunFolder
from atma_titan.sweep.plan import Cell

CELLS_FOLDER = "cells"
FAILED_MARKER = "FAILED"  # stage, exit status, command and log tail of the last failure
TRAIN_LOG, EVAL_LOG = "train.log", "eval.log"


@dataclass(frozen=True)
class CellFolder:
    path: Path

    @classmethod
    def of(cls, out: Path, cell: Cell) -> CellFolder:
        return cls(Path(out) / CELLS_FOLDER / cell.name)

    @property
    def run_dir(self) -> Path:
        return self.path / "run"

    @property
    def run(self) -> RunFolder:
        return RunFolder.of(self.run_dir)

    @property
    def eval_dir(self) -> Path:
        return self.path / "eval"

    @property
    def results(self) -> Path:
        return self.eval_dir / RESULTS_JSON

    @property
    def failed(self) -> Path:
        return self.path / FAILED_MARKER

    def trained(self) -> bool:
        return self.run.done.is_file()

    def evaluated(self) -> bool:
        return self.results.is_file()

    def status(self, need_eval: bool = True) -> str:
        """done | trained | failed | pending (trained counts as finished when need_eval is False)."""
        trained, evaluated = self.trained(), self.evaluated()
        if trained and (evaluated or not need_eval):
            return "done" if evaluated else "trained"
        if self.failed.is_file():
            return "failed"
        return "trained" if trained else "pending"

    def failure(self) -> str:
        """The first line of FAILED: 'stage: reason'."""
        lines = self.failed.read_text().splitlines()
        return lines[0] if lines else "?"

    def final_train_metrics(self) -> dict | None:
        """The last logged step (metrics.jsonl is appended across resumes: the last row is the newest)."""
        steps = [row for row in self.run.logged_steps() if isinstance(row["loss"], (int, float))]
        return steps[-1] if steps else None

    def latest_checkpoint_step(self) -> int | None:
        return self.run.latest_checkpoint_step()

    def read_results(self) -> dict | None:
        try:
            return json.loads(self.results.read_text())
        except (OSError, ValueError):
            return None
