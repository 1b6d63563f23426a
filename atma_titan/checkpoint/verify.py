"""Checking one checkpoint directory against its manifest, a share of the files per rank.

`local_problems(ckpt, marker, rank, world_size)` checks the files this rank is given (file i of the
sorted manifest goes to rank i % world_size): size, xxh3_64 digest, and that the kinds that get
unpickled can be read safely (`.metadata` through the DCP allowlist, rank files with
weights_only=True). Rank 0 also checks that the manifest lists every file present and that the
`.metadata` references only files the manifest lists, at sizes that hold the data. The caller
gathers every rank's list, so all ranks reach the same verdict. An empty list: the checkpoint verifies.

A checkpoint saved before manifests existed (`marker.files is None`) cannot be verified; only its
`.metadata` is read (safely) and the files it references are checked to exist and be long enough.
"""

from __future__ import annotations

from pathlib import Path

from atma_titan.checkpoint.errors import CheckpointError
from atma_titan.checkpoint.manifest import FileEntry, Marker, check_file, unlisted_files
from atma_titan.checkpoint.safe_unpickle import METADATA_NAME, load_rank_file, read_metadata_file

RANK_STATE_DIR = "rank_state"

__all__ = ["RANK_STATE_DIR", "local_problems", "rank_file", "shares"]


def rank_file(rank: int) -> str:
    """This rank's private state file, relative to the step directory."""
    return f"{RANK_STATE_DIR}/rank-{rank}.pt"


def shares(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files `rank` verifies: every world_size-th of the sorted list, starting at `rank`."""
    return sorted(names)[rank::world_size]


def local_problems(ckpt: Path, marker: Marker, rank: int, world_size: int) -> list[str]:
    """'file: what is wrong' for each problem this rank finds in its share of `ckpt`."""
    if marker.files is None:
        return _legacy_problems(ckpt) if rank == 0 else []
    problems = []
    for name in shares(list(marker.files), rank, world_size):
        problem = check_file(ckpt, name, marker.files[name]) or _unpickle_problem(ckpt, name, marker.files)
        if problem:
            problems.append(f"{name}: {problem}")
    if rank == 0:
        unlisted = [name for name in unlisted_files(ckpt, marker.files) if _is_checkpoint_file(name)]
        problems += [f"{name}: present, but not in the manifest" for name in unlisted]
        if METADATA_NAME not in marker.files:
            problems.append(f"{METADATA_NAME}: not in the manifest")
    return problems


def _is_checkpoint_file(name: str) -> bool:
    """A kind of file a save writes. An unlisted one means the directory is not what was saved (another job
    wrote into it); other files (a README, an editor's backup) are never read by a load and do not count."""
    return name == METADATA_NAME or name.endswith(".distcp") or name.startswith(f"{RANK_STATE_DIR}/")


def _unpickle_problem(ckpt: Path, name: str, files: dict[str, FileEntry]) -> str | None:
    """Whether a file that gets unpickled reads safely (its digest already matched)."""
    try:
        if name == METADATA_NAME:
            return _referenced_problem(ckpt, {k: v.size for k, v in files.items()}, in_manifest=True)
        if name.startswith(f"{RANK_STATE_DIR}/") and name.endswith(".pt"):
            load_rank_file(ckpt / name)
    except CheckpointError as e:
        return _relative(str(e), ckpt / name)
    return None


def _legacy_problems(ckpt: Path) -> list[str]:
    sizes = {}
    for path in ckpt.rglob("*.distcp"):
        sizes[path.relative_to(ckpt).as_posix()] = path.stat().st_size
    try:
        problem = _referenced_problem(ckpt, sizes, in_manifest=False)
    except CheckpointError as e:
        problem = _relative(str(e), ckpt / METADATA_NAME)
    return [f"{METADATA_NAME}: {problem}"] if problem else []


def _referenced_problem(ckpt: Path, sizes: dict[str, int], *, in_manifest: bool) -> str | None:
    """The .metadata reads through the allowlist, and every byte range it names lies inside a known file."""
    metadata = read_metadata_file(ckpt / METADATA_NAME)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            needed[path] = max(needed.get(path, 0), int(info.offset) + int(info.length))
    for path, end in sorted(needed.items()):
        if path not in sizes:
            return f"references {path}, which {'the manifest does not list' if in_manifest else 'is missing'}"
        if sizes[path] < end:
            return f"references {end:,} bytes of {path}, which holds {sizes[path]:,}"
    return None


def _relative(message: str, path: Path) -> str:
    """An error message about `path`, without the path (the caller names the file)."""
    prefix = str(path)
    return message[len(prefix) :].lstrip(": ") if message.startswith(prefix) else message
