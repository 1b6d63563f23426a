"""utils/atomic.py: a whole-file write leaves the old file or the new one, with the ordinary mode, no temporary
file behind, and (durable=True) the file and its folder synced to the disk before the call returns."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest

from atma_titan.utils.atomic import (
    create_text_exclusive,
    write_bytes_atomic,
    write_dir_atomic,
    write_file_atomic,
    write_json_atomic,
    write_text_atomic,
)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def private_writer(data: bytes):
    """A writer like safetensors' save_file: it makes its own file, readable by its owner only."""

    def write(tmp: Path) -> None:
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    return write


@pytest.fixture
def synced(monkeypatch):
    """The paths os.fsync is called on, in order (read back from the descriptor)."""
    calls: list[Path] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_writes_have_the_ordinary_mode_under_umask_022(tmp_path, umask_022):
    write_text_atomic(tmp_path / "a.txt", "text\n")
    write_bytes_atomic(tmp_path / "b.bin", b"\x00\x01")
    write_json_atomic(tmp_path / "c.json", {"x": 1})
    write_file_atomic(tmp_path / "model.safetensors", private_writer(b"weights"))
    assert (tmp_path / "a.txt").read_text() == "text\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "c.json").read_text() == '{\n  "x": 1\n}\n'
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"
    assert {p.name: mode(p) for p in tmp_path.iterdir()} == {
        "a.txt": 0o644, "b.bin": 0o644, "c.json": 0o644, "model.safetensors": 0o644,
    }  # fmt: skip


def test_the_mode_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_file_atomic(tmp_path / "w", private_writer(b"x"))
        create_text_exclusive(tmp_path / "LOCK", "{}")
    finally:
        os.umask(old)
    assert mode(tmp_path / "w") == 0o640 and mode(tmp_path / "LOCK") == 0o640


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "state.json"
    write_json_atomic(target, {"step": 1})

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text('{"st')
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_file_atomic(target, half_then_fail)
    with pytest.raises(TypeError):
        write_json_atomic(target, {"not json": object()})
    assert json.loads(target.read_text()) == {"step": 1}
    assert leftovers(tmp_path) == []


def test_replacing_leaves_only_the_target(tmp_path):
    target = tmp_path / "DONE"
    for step in range(3):
        write_text_atomic(target, f"{step}\n")
    assert target.read_text() == "2\n" and [p.name for p in tmp_path.iterdir()] == ["DONE"]


def test_durable_syncs_the_file_before_the_rename_and_the_folder_after(tmp_path, synced):
    target = tmp_path / "COMPLETE"
    write_text_atomic(target, "{}", durable=True)
    assert len(synced) == 2
    temporary, folder = synced
    assert temporary.parent == tmp_path and temporary.name.startswith(".COMPLETE.") and temporary.suffix == ".tmp"
    assert folder == tmp_path
    synced.clear()
    write_text_atomic(target, "{}")
    assert synced == []  # not durable: no sync


def test_concurrent_writers_never_share_a_temporary_file(tmp_path):
    target = tmp_path / "shared.txt"
    texts = [str(i) * 100_000 for i in range(8)]
    errors = []

    def write(text: str) -> None:
        try:
            for _ in range(5):
                write_text_atomic(target, text)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_text() in texts and leftovers(tmp_path) == []


def test_create_text_exclusive_creates_once(tmp_path, synced):
    lock = tmp_path / "LOCK"
    assert create_text_exclusive(lock, "first\n", durable=True)
    assert synced[-1] == tmp_path  # the folder, after the link
    assert not create_text_exclusive(lock, "second\n")
    assert lock.read_text() == "first\n" and leftovers(tmp_path) == []


def test_create_text_exclusive_without_hard_links(tmp_path, monkeypatch, umask_022):
    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    lock = tmp_path / "LOCK"
    assert create_text_exclusive(lock, "first\n", durable=True)
    assert not create_text_exclusive(lock, "second\n")
    assert lock.read_text() == "first\n" and mode(lock) == 0o644 and leftovers(tmp_path) == []


def test_write_dir_atomic_replaces_the_folder_whole(tmp_path, umask_022, synced):
    out = tmp_path / "export"
    out.mkdir()
    (out / "model-00002-of-00002.safetensors").write_text("stale shard")

    def fill(folder: Path) -> None:
        private_writer(b"weights")(folder / "model.safetensors")
        (folder / "config.json").write_text("{}")

    write_dir_atomic(out, fill, durable=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert {p.name: mode(p) for p in out.iterdir()} == {"config.json": 0o644, "model.safetensors": 0o644}
    assert mode(out) == 0o755 and leftovers(tmp_path) == []
    assert synced[-1] == tmp_path and len(synced) == 4  # two files, the folder, then its parent


def test_write_dir_atomic_failing_leaves_the_old_folder(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text("old")

    def fill(folder: Path) -> None:
        (folder / "config.json").write_text("new")
        raise RuntimeError("the tokenizer could not be saved")

    with pytest.raises(RuntimeError, match="tokenizer"):
        write_dir_atomic(out, fill)
    assert (out / "config.json").read_text() == "old" and leftovers(tmp_path) == []
