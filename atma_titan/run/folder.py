"""The layout of a run folder, defined once (torch-free: the sweep and the eval loader read it too).

<job.dump_folder>/
  config.toml                   the run's resolved config (written at start)
  metrics.jsonl                 one JSON object per logged step, and {"event": ...} rows
  DONE                          the last step, written once every step is trained
  model.safetensors             the exported final weights (checkpoint.export_safetensors)
  <checkpoint.folder>/          "checkpoints" by default
    step-<N>/                   one checkpoint; it counts only once it holds COMPLETE
      COMPLETE                  JSON with the manifest (every file's size and xxh3_64): checkpoint_manifest.py
    rolled_back/<time>/step-<N> checkpoints a checkpoint.load_step rollback set aside (never read again)
  eval/                         the eval command's results
  bad_batches/step-<N>/         what a non-finite or spiking step trained on (run/bad_batch.py)
  hangs/step-<N>.rank-<R>.txt   each rank's stacks when a step hung (run/watchdog.py)
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from atma_titan.utils.atomic import write_text_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_NAME = "config.toml"
METRICS_NAME = "metrics.jsonl"
DONE_NAME = "DONE"
SAFETENSORS_NAME = "model.safetensors"
EVAL_FOLDER = "eval"
DEFAULT_CHECKPOINT_FOLDER = "checkpoints"
COMPLETE_NAME = "COMPLETE"

_STEP_PREFIX = "step-"
_STEP_DIR = re.compile(rf"^{_STEP_PREFIX}(\d+)$")

__all__ = [
    "COMPLETE_NAME",
    "CONFIG_NAME",
    "DONE_NAME",
    "EVAL_FOLDER",
    "METRICS_NAME",
    "SAFETENSORS_NAME",
    "RunFolder",
    "complete_steps",
    "is_complete",
    "latest_complete_step",
    "read_metrics",
    "step_dir",
    "step_dirs",
    "step_of",
]


# ---------------------------------------------------------------------------------------------
# Checkpoint folders: step-<N> directories and their COMPLETE markers


def step_dir(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"{_STEP_PREFIX}{step}"


def step_of(path: str | Path) -> int | None:
    """N for a directory named step-<N>, else None."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def step_dirs(folder: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) for every step-<N> directory, complete or not, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(step_of(p), p) for p in folder.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


def is_complete(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / COMPLETE_NAME).is_file()


def complete_steps(folder: str | Path) -> list[int]:
    return [s for s, p in step_dirs(folder) if is_complete(p)]


def latest_complete_step(folder: str | Path) -> int | None:
    steps = complete_steps(folder)
    return steps[-1] if steps else None


def read_metrics(path: str | Path) -> list[dict]:
    """The JSON objects of a metrics.jsonl, in order (a line cut short by a crash is skipped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# The run folder


@dataclass(frozen=True)
class RunFolder:
    """Paths inside one run's dump folder. `checkpoint_folder` is `[checkpoint] folder` (relative)."""

    path: Path
    checkpoint_folder: str = DEFAULT_CHECKPOINT_FOLDER

    @classmethod
    def of(cls, path: str | Path) -> RunFolder:
        """The run folder at `path`, with the checkpoint folder its config.toml names (if it has one)."""
        path = Path(path)
        try:
            saved = tomllib.loads((path / CONFIG_NAME).read_text())
            folder = saved.get("checkpoint", {}).get("folder", DEFAULT_CHECKPOINT_FOLDER)
        except (OSError, tomllib.TOMLDecodeError):
            folder = DEFAULT_CHECKPOINT_FOLDER
        return cls(path, folder)

    @property
    def config(self) -> Path:
        return self.path / CONFIG_NAME

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_NAME

    @property
    def done(self) -> Path:
        return self.path / DONE_NAME

    @property
    def safetensors(self) -> Path:
        return self.path / SAFETENSORS_NAME

    @property
    def eval(self) -> Path:
        return self.path / EVAL_FOLDER

    @property
    def checkpoints(self) -> Path:
        return self.path / self.checkpoint_folder

    def done_step(self) -> int | None:
        """The step DONE records, or None when the run is not finished (or DONE is unreadable)."""
        try:
            return int(self.done.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def write_done(self, step: int) -> None:
        write_text_atomic(self.done, f"{step}\n")

    def latest_checkpoint_step(self) -> int | None:
        return latest_complete_step(self.checkpoints)

    def logged_steps(self) -> list[dict]:
        """The step rows of metrics.jsonl (those with a loss), oldest first."""
        return [row for row in read_metrics(self.metrics) if "step" in row and "loss" in row]
