"""Whole-file writes: a temporary file, then a rename, so a reader (another rank, a sweep's array task, a
collector) sees the old file or the new one, never half of one. Torch-free."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two tasks never share one
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
