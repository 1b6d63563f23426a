"""The COMPLETE marker of a checkpoint and the manifest it carries: every file's size and xxh3_64 digest.

Torch-free (xxhash and the standard library), so anything that lists or checks checkpoints can use it.

COMPLETE is one JSON object:

    {"format": 2, "step": 500, "world_size": 8, "time": ..., "torch": "2.13.0", "load_step": -1,
     "files": {".metadata": {"size": 312392, "xxh3_64": "9f0c..."}, "__0_0.distcp": {...},
               "rank_state/rank-0.pt": {...}, ...},
     "xxh3_64": "<digest of the object without this key>"}

The marker's own digest makes any change to it (a flipped byte in a size, a step, the time) detectable,
so a damaged marker is never mistaken for a good one. Markers written before manifests existed hold
only step, world_size, time and torch: they read as `Marker.files is None` (a checkpoint that can be
loaded, but not verified).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from atma_titan.run.folder import COMPLETE_NAME
from atma_titan.utils.atomic import write_text_atomic

MARKER_FORMAT = 2
DIGEST = "xxh3_64"
CHUNK_BYTES = 8 << 20  # big enough to run at memory speed, small enough to keep no file in memory

_LEGACY_KEYS = {"step", "world_size", "time", "torch"}

__all__ = [
    "CHUNK_BYTES",
    "DIGEST",
    "FileEntry",
    "Marker",
    "MarkerError",
    "check_file",
    "files_on_disk",
    "hash_file",
    "read_marker",
    "unlisted_files",
    "write_marker",
]


class MarkerError(ValueError):
    """A COMPLETE marker that cannot be read, parsed or trusted; the message says what is wrong."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    digest: str  # xxh3_64, 16 hex digits

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, DIGEST: self.digest}


@dataclass(frozen=True)
class Marker:
    step: int
    world_size: int
    load_step: int  # checkpoint.load_step of the run that saved it (-1: none); see CheckpointManager.select
    files: dict[str, FileEntry] | None  # relative path -> entry; None for a marker without a manifest

    @property
    def verifiable(self) -> bool:
        return self.files is not None


def hash_file(path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> FileEntry:
    """Size and xxh3_64 of a file, read in chunks into one reused buffer."""
    digest = xxhash.xxh3_64()
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return FileEntry(size, digest.hexdigest())


def check_file(root: Path, relative: str, entry: FileEntry) -> str | None:
    """What is wrong with `root/relative` against its manifest entry, or None when it matches."""
    path = root / relative
    try:
        if not path.is_file():
            return "missing" if not path.exists() else "is not a regular file"
        size = path.stat().st_size
        if size != entry.size:
            shape = "truncated" if size < entry.size else "longer than written"
            return f"{size:,} bytes, the manifest says {entry.size:,} ({shape})"
        got = hash_file(path)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if got.size != entry.size:  # changed while we read it
        return f"{got.size:,} bytes read, the manifest says {entry.size:,}"
    if got.digest != entry.digest:
        return f"{DIGEST} {got.digest} differs from the manifest's {entry.digest} (the content changed)"
    return None


def files_on_disk(root: Path) -> list[str]:
    """Every regular file under `root` except COMPLETE itself, as sorted relative POSIX paths."""
    names = []
    for path in root.rglob("*"):
        if path.is_file() and path.name != COMPLETE_NAME:
            names.append(path.relative_to(root).as_posix())
    return sorted(names)


def unlisted_files(root: Path, files: dict[str, FileEntry]) -> list[str]:
    """Files present under `root` that the manifest does not list (the directory is not what was saved)."""
    return [name for name in files_on_disk(root) if name not in files]


# ---------------------------------------------------------------------------------------------
# The marker


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_marker(checkpoint: Path, info: dict[str, Any], files: dict[str, FileEntry]) -> None:
    """Write COMPLETE with `info` (step, world_size, ...) and the manifest, atomically and durably."""
    body = {"format": MARKER_FORMAT, **info, "files": {k: files[k].to_json() for k in sorted(files)}}
    body[DIGEST] = xxhash.xxh3_64(_canonical(body)).hexdigest()
    write_text_atomic(checkpoint / COMPLETE_NAME, json.dumps(body, indent=1, sort_keys=True), durable=True)


def read_marker(checkpoint: Path) -> Marker:
    """The parsed COMPLETE of `checkpoint`; MarkerError says what is wrong with it."""
    path = checkpoint / COMPLETE_NAME
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise MarkerError(f"{COMPLETE_NAME} is missing") from None
    except OSError as e:
        raise MarkerError(f"{COMPLETE_NAME} is unreadable ({e.strerror or e})") from None
    except ValueError as e:  # not UTF-8, not JSON: truncated or damaged
        raise MarkerError(f"{COMPLETE_NAME} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise MarkerError(f"{COMPLETE_NAME} is not a JSON object")
    if set(raw) <= _LEGACY_KEYS and {"step", "world_size"} <= set(raw):
        return Marker(_int(raw, "step"), _int(raw, "world_size"), -1, None)
    claimed = raw.pop(DIGEST, None)
    if claimed != xxhash.xxh3_64(_canonical(raw)).hexdigest():
        raise MarkerError(f"{COMPLETE_NAME} does not match its own {DIGEST} digest (the marker was changed)")
    if raw.get("format") != MARKER_FORMAT:
        raise MarkerError(f"{COMPLETE_NAME} has format {raw.get('format')!r}; this version reads {MARKER_FORMAT}")
    files = raw.get("files")
    if not isinstance(files, dict):
        raise MarkerError(f"{COMPLETE_NAME} has no 'files' manifest")
    try:
        entries = {str(k): FileEntry(int(v["size"]), str(v[DIGEST])) for k, v in files.items()}
    except (TypeError, KeyError, ValueError):
        raise MarkerError(f"{COMPLETE_NAME} has a malformed 'files' entry") from None
    outside = [name for name in entries if not _inside(name)]
    if outside:  # a manifest only ever names files inside its own directory
        raise MarkerError(f"{COMPLETE_NAME} lists paths outside the checkpoint: {', '.join(outside)}")
    return Marker(_int(raw, "step"), _int(raw, "world_size"), _int(raw, "load_step", -1), entries)


def _inside(relative: str) -> bool:
    parts = Path(relative).parts
    return bool(parts) and not Path(relative).is_absolute() and ".." not in parts


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MarkerError(f"{COMPLETE_NAME} has {key} = {value!r}; expected an integer")
    return value
