"""Reading checkpoint files without executing code from them.

A pickle names the callables it runs when unpickled; a crafted file can name `os.system`. Every
pickle a checkpoint holds is therefore read through an allowlist:

- DCP's `.metadata` (plain pickle in torch's own reader) through `MetadataUnpickler`, which admits
  only the torch.distributed.checkpoint metadata classes, torch dtypes, torch.Size, torch's layout
  lookup and pathlib paths: the types DCP writes there (found by pickling the metadata of real
  checkpoints: the debug model on 1 process and on 2 FSDP2 ranks, with optimizer state). It is
  plugged into DCP through its public API: `SafeFileSystemReader.read_metadata`.
- the small non-tensor values DCP stores in the .distcp files (the train state, LR schedules,
  param groups), which torch's default load planner reads with `torch.load(weights_only=False)`:
  `SafeLoadPlanner` checks each with `weights_only=True` first.
- the per-rank files (rank_state/rank-R.pt) with `torch.load(weights_only=True)`; `safe_bytes`
  refuses at save time a rank state that such a load would reject.

Tensors in .distcp files are read by DCP with weights_only=True already; .safetensors files hold no
code by design. Anything else is refused with UnsafeCheckpointError naming the file and the class.
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from atma_titan.checkpoint.errors import CheckpointError, UnsafeCheckpointError

METADATA_NAME = ".metadata"  # DCP's global metadata file

# (module, name) DCP's metadata pickle may name. Resolved lazily, so a name this torch version lacks
# costs nothing until a file asks for it (torch 2.11 and 2.13 write the same set).
_METADATA_CLASSES = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    )]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout: a lookup by name
        ("collections", "OrderedDict"),
    ]
    + [(module, name) for module in ("pathlib", "pathlib._local") for name in (
        "Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath",
    )]  # StorageMeta.checkpoint_id
)  # fmt: skip

__all__ = [
    "METADATA_NAME",
    "MetadataUnpickler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "load_rank_file",
    "read_metadata_file",
    "safe_bytes",
    "short_reason",
]


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: any other global is refused before it is imported."""

    def __init__(self, file: Any, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _METADATA_CLASSES:
            raise UnsafeCheckpointError(
                f"{self.path}: refusing to unpickle {module}.{name}: a DCP {METADATA_NAME} holds only "
                "torch.distributed.checkpoint metadata types (this file was not written by DCP, or was altered)"
            )
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            raise CheckpointError(
                f"{self.path} needs {module}.{name}, which torch {torch.__version__} does not have "
                "(written by another torch version?)"
            ) from None


def read_metadata_file(path: str | Path) -> Metadata:
    """DCP metadata from `path` through the allowlist; CheckpointError says what is wrong with the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # truncated, flipped bytes: pickle raises many kinds of errors
        raise CheckpointError(f"{path} is unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` read through MetadataUnpickler instead of plain pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if hasattr(self, "_get_metadata_path"):
            path = Path(self._get_metadata_path(rank))
        else:  # older FileSystemReader: only the global file
            path = Path(self.path) / METADATA_NAME
        metadata = read_metadata_file(path)
        # What FileSystemReader.read_metadata does after unpickling.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's read, with an error naming the .distcp file it came from."""
        self._reading: str | None = None
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as e:
            files = self._reading or " or ".join(
                sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
            )
            raise CheckpointError(f"{files}: {short_reason(e)}") from None

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        # Called for every item read (a private hook of FileSystemReader: if a torch version has none,
        # the error above names every file this rank reads instead).
        self._reading = getattr(sinfo, "relative_path", None)
        return super()._slice_file(file, sinfo)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor value must load with weights_only=True."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            where = getattr(info, "relative_path", "a .distcp file")
            raise UnsafeCheckpointError(
                f"{where}: the value of {read_item.dest_index.fqn!r} cannot be loaded safely ({short_reason(e)})"
            ) from None
        # The restricted load accepted every global this pickle names, so the full load below runs
        # only those same constructors: it adds no code, and keeps DCP's own placement logic.
        value.seek(0)
        super().load_bytes(read_item, value)


def load_rank_file(path: str | Path) -> Any:
    """A rank_state file, loaded with weights_only=True; CheckpointError names the file and the reason."""
    path = Path(path)
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"{path}: refused by torch.load(weights_only=True): {short_reason(e)}") from None
    except Exception as e:
        raise CheckpointError(f"{path} is unreadable: {short_reason(e)}") from None


def safe_bytes(obj: Any, what: str) -> bytes:
    """torch.save of `obj`, refused (TypeError) unless torch.load(weights_only=True) reads it back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except pickle.UnpicklingError as e:
        raise TypeError(
            f"{what} must hold only tensors, plain containers, numbers, strings, bytes and None "
            f"(it is loaded with weights_only=True): {short_reason(e)}"
        ) from None
    return buffer.getvalue()


def short_reason(error: BaseException) -> str:
    """One line for an error: torch's weights_only message is a page, its reason one sentence of it."""
    text = str(error)
    if text.startswith("Weights only load failed"):
        # Its wording varies between torch versions; the reason follows "WeightsUnpickler error:" or names a GLOBAL.
        if "WeightsUnpickler error:" in text:
            reason = text.split("WeightsUnpickler error:", 1)[1]
        else:
            reason = " ".join(line for line in text.splitlines() if "GLOBAL" in line)
        reason = " ".join(reason.split("Check the documentation")[0].split()).split(". ")[0]
        if reason:
            return reason
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0].split(". ")[0] if lines else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
