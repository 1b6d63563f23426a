"""Whole-file writes: the content goes to a temporary file beside the target, which is then renamed over it,
so a reader (another rank, a sweep's array task, a collector, a resuming run) sees the old file or the new
one, never half of one. Torch-free.

- The temporary file is `.<name>.<random hex>.tmp` in the target's folder: the rename stays on one
  filesystem, the random part keeps processes and threads writing the same target apart, and a failed
  write removes it.
- The file gets the mode a plain `open(path, "w")` would give it (0o666 less the umask: 0o644 under the
  usual umask 022), also where the writer creates it private (safetensors' save_file makes 0o600 files).
- `durable=True` fsyncs the file before the rename and its folder after it, so that once the call
  returns the new file survives a crash of the host, not only of the process. It is for what a later run
  trusts without rereading: a checkpoint's COMPLETE marker and its rank files, exported weights, a run
  folder's LOCK. Without it the rename may reach the disk before the content.

`write_file_atomic` takes a writer (a callable given the temporary path); `write_bytes_atomic`,
`write_text_atomic` and `write_json_atomic` are it for in-memory content; `write_dir_atomic` makes a whole
folder the same way; `create_text_exclusive` creates a file only where none exists (a lock).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = [
    "create_text_exclusive",
    "write_bytes_atomic",
    "write_dir_atomic",
    "write_file_atomic",
    "write_json_atomic",
    "write_text_atomic",
]

# os.link's errors on a filesystem without hard links (some FUSE and SMB mounts)
_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)


def _temporary_name(path: Path) -> Path:
    """A fresh hidden name beside `path` for its temporary file or folder."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


@contextmanager
def _temporary_file(path: Path) -> Iterator[tuple[Path, int]]:
    """(an empty temporary file beside `path`, the ordinary file mode); the file is gone afterwards unless renamed.

    Creating it with 0o666 lets the kernel apply the umask, which a thread cannot read safely otherwise."""
    tmp = _temporary_name(path)
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        mode = os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
    try:
        yield tmp, mode
    finally:
        tmp.unlink(missing_ok=True)  # after the rename there is nothing left to remove


def _fsync_path(path: Path) -> None:
    """Flush a file's or a folder's content (a folder's: the names in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems cannot sync a folder; the file itself was synced
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP) or not path.is_dir():
            raise
    finally:
        os.close(fd)


def write_file_atomic(path: str | Path, write: Callable[[Path], Any], *, durable: bool = False) -> None:
    """`write(tmp)` writes the file at the temporary path `tmp`, which then replaces `path` whole."""
    path = Path(path)
    with _temporary_file(path) as (tmp, mode):
        write(tmp)
        os.chmod(tmp, mode)  # the writer may have replaced the file with a private one
        if durable:
            _fsync_path(tmp)
        os.replace(tmp, path)
    if durable:
        _fsync_path(path.parent)


def write_bytes_atomic(path: str | Path, data: bytes, *, durable: bool = False) -> None:
    write_file_atomic(path, lambda tmp: tmp.write_bytes(data), durable=durable)


def write_text_atomic(path: str | Path, text: str, *, durable: bool = False) -> None:
    write_file_atomic(path, lambda tmp: tmp.write_text(text), durable=durable)


def write_json_atomic(path: str | Path, data: Any, *, durable: bool = False) -> None:
    """`data` as indented JSON with a final newline."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n", durable=durable)


def write_dir_atomic(path: str | Path, fill: Callable[[Path], Any], *, durable: bool = False) -> None:
    """`fill(tmp)` writes a folder's files into the fresh temporary folder `tmp`, which then replaces `path`.

    A folder already at `path` is removed just before the rename (no stale file of it survives), so a
    reader may briefly find no folder there, but never a half-written one. On any error the temporary
    folder is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(path)
    tmp.mkdir()
    try:
        fill(tmp)
        _ordinary_modes(tmp, durable)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after the rename there is nothing left to remove
    if durable:
        _fsync_path(path.parent)


def _ordinary_modes(folder: Path, durable: bool) -> None:
    """Give every file under `folder` the ordinary file mode (its folder's, made by mkdir, less execute)."""
    mode = folder.stat().st_mode & 0o666
    for item in sorted(folder.rglob("*")):
        if item.is_symlink():
            continue
        if item.is_file():
            os.chmod(item, mode)
        if durable:
            _fsync_path(item)
    if durable:
        _fsync_path(folder)


def create_text_exclusive(path: str | Path, text: str, *, durable: bool = False) -> bool:
    """Create `path` holding `text`, whole, unless a file is there already: then False and nothing changes.

    The text goes to a temporary file, hard-linked to `path` (atomic and exclusive, also on NFS). On a
    filesystem without hard links the file is created exclusively and then written, so a reader may see
    it empty or partly written for a moment."""
    path = Path(path)
    with _temporary_file(path) as (tmp, _mode):
        tmp.write_text(text)
        if durable:
            _fsync_path(tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
        else:
            if durable:
                _fsync_path(path.parent)
            return True
    return _create_then_write(path, text, durable)


def _create_then_write(path: Path, text: str, durable: bool) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    if durable:
        _fsync_path(path.parent)
    return True
