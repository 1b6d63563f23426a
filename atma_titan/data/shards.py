"""llm.c token shards: a random-access window source over `.bin` files, and the shard writer.

File format (little-endian throughout)::

    int32[256] header   [0] magic, [1] version, [2] token count, the rest zero
    tokens              `count` unsigned ids, 2 or 4 bytes each

    magic     version  tokens   origin
    20240520  1        uint16   llm.c GPT-2 shards (e.g. kjj0/finewebedu10B-gpt2)
    20240520  2        uint32   atma_titan extension for vocabularies over 65,535 ids
    20240801  7        uint32   llm.c llama-3 shards (read only)

Version 2 is ours: `write_shard` uses it only when an id does not fit uint16, so shards of a
GPT-2-sized vocabulary stay readable by llm.c itself (which rejects version 2). Documents are
written with the tokenizer's EOT *before* each one (50256 for GPT-2), as llm.c does; this module
does not look at document boundaries at all.

Window layout: the shards, sorted by name, are one token stream of `T` tokens. Window `i` of
length `L` (a training sequence plus its shifted label, `seq_len + 1`) starts at token
`i * (L - 1)`, so consecutive windows share one boundary token and every token after the first is
a label exactly once per epoch::

    stream   t0 t1 t2 t3 t4 t5 t6 t7 t8 t9 ...
    i = 0    t0 t1 t2 t3 t4                      (L = 5)
    i = 1                t4 t5 t6 t7 t8
    i = 2                            t8 ...

An epoch holds `(T - 1) // (L - 1)` windows; index `i` reads window `i mod` that, so the stream
wraps to the start without a window straddling the wrap (the tail of fewer than `L - 1` tokens is
skipped each epoch). A window may span shards; it is their concatenation.

`window(i, L)` is a pure function of the shard files, `i` and `L`: the loader holds the position.
Local files are memory-mapped, remote ones (any fsspec URL: s3://, gs://, https://, memory://)
are read with ranged reads, so nothing is downloaded up front and construction reads headers only.
Remote access goes through atma_titan.data.remote: a missing back-end names the `remote` extra,
reads are retried on transient failures, and 404 / 403 / a server without range requests are
clear errors. An HTTP listing (an HTML index page) gives no sizes: then the headers do.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from atma_titan.data.remote import check_range_support, http_status, is_http, is_transient, retrying, url_to_fs
from atma_titan.utils.errors import InputError
from atma_titan.utils.redact import redact_text, redact_url

__all__ = ["BinShards", "ShardError", "ShardHeader", "read_header", "write_shard"]

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAGIC_GPT2 = 20240520
MAGIC_LLAMA3 = 20240801
# (magic, version) -> token dtype. Versions differ across rows, so the version alone names the layout.
LAYOUTS = {
    (MAGIC_GPT2, 1): np.dtype("<u2"),
    (MAGIC_GPT2, 2): np.dtype("<u4"),
    (MAGIC_LLAMA3, 7): np.dtype("<u4"),
}
_MAX_COUNT = 2**31 - 1  # the header stores the count as int32
_WRITE_CHUNK = 1 << 24  # tokens converted per write, so a big shard is not copied whole
_REMOTE_BLOCK = 4 << 20  # read-ahead per remote file: a rank's next windows are usually just after
_MAX_OPEN_REMOTE = 4  # open remote files kept per process (each holds up to one read-ahead block)
# Fields of fsspec's info() that change with a remote file's content (s3, gcs, http, memory).
_VERSION_FIELDS = (
    "ETag",
    "etag",
    "md5Hash",
    "generation",
    "LastModified",
    "Last-Modified",
    "mtime",
    "updated",
    "created",
)


class ShardError(InputError):
    """A token shard (or set of shards) that cannot be read or written; the message names the file."""


@dataclass(frozen=True)
class ShardHeader:
    path: str
    version: int
    num_tokens: int
    dtype: np.dtype
    header_bytes: int = HEADER_BYTES

    @property
    def file_bytes(self) -> int:
        """Size the file must have: header plus tokens."""
        return self.header_bytes + self.num_tokens * self.dtype.itemsize


# ---------------------------------------------------------------------------------------- headers


def _parse_header(url: str, raw: bytes, size: int | None) -> ShardHeader:
    """Check a shard's header bytes against its file size (`size` bytes; None: unknown, e.g. an HTTP listing).

    With the size unknown the header's count is trusted; a truncated file then fails on the read of
    its missing tokens, with a message naming it."""
    if (size if size is not None else len(raw)) < HEADER_BYTES or len(raw) < HEADER_BYTES:
        raise ShardError(
            f"{url} is {size if size is not None else len(raw)} bytes, shorter than the {HEADER_BYTES}-byte llm.c "
            f"header: not an llm.c token shard, or an interrupted download or write; fetch or write it again"
        )
    magic, version, count = (int(v) for v in np.frombuffer(raw[:12], dtype="<i4"))
    if magic not in (MAGIC_GPT2, MAGIC_LLAMA3):
        raise ShardError(
            f"{url}: bad magic {magic} (expected {MAGIC_GPT2} or {MAGIC_LLAMA3}): not an llm.c token shard"
        )
    dtype = LAYOUTS.get((magic, version))
    if dtype is None:
        known = ", ".join(f"{v} (magic {m})" for m, v in LAYOUTS)
        raise ShardError(f"{url}: unknown shard version {version} for magic {magic}; known versions: {known}")
    if count < 0:
        raise ShardError(f"{url}: negative token count {count} in the header: the shard is corrupt")
    header = ShardHeader(url, version, count, dtype)
    if size is not None and size != header.file_bytes:
        held = (size - HEADER_BYTES) // dtype.itemsize
        problem = "truncated" if size < header.file_bytes else "longer than its header says"
        raise ShardError(
            f"{url} is {problem}: the header says {count} tokens ({header.file_bytes} bytes with the header) "
            f"but the file is {size} bytes, room for {held} tokens; an interrupted download or write? "
            f"fetch or write it again"
        )
    return header


def read_header(path: str) -> ShardHeader:
    """Read and check the header of the shard at `path` (a local path or any fsspec URL)."""
    fs, fspath = url_to_fs(path, "shard")
    size = _file_size(fs, fspath, path)
    check_range_support(fs, fspath, path)
    small = size is not None and size < HEADER_BYTES
    raw = b"" if small else _remote(fs, path, "reading the header", lambda: fs.cat_file(fspath, 0, HEADER_BYTES))
    return _parse_header(path, raw, size)


def _remote(fs, url: str, doing: str, call):
    """`call()`: as it is on a local disk, with retries and clear errors on a remote store."""
    return call() if isinstance(fs, LocalFileSystem) else retrying(url, doing, call)


def _file_size(fs, fspath: str, url: str) -> int | None:
    """Size in bytes of the file at `fspath` (None: the server does not say)."""
    try:
        info = _remote(fs, url, "looking it up", lambda: fs.info(fspath))
    except FileNotFoundError:  # a local file; a remote one raises RemoteDataError, which says "not found" too
        raise ShardError(f"shard {url} not found: check the path") from None
    if info.get("type") == "directory":
        raise ShardError(f"{url} is a directory, not a shard; give a file or a glob such as {url}/*.bin")
    return None if info.get("size") is None else int(info["size"])


# ---------------------------------------------------------------------------------------- writing


def _token_array(path: str, tokens) -> np.ndarray:
    """`tokens` as a 1-D integer array, or a ShardError naming `path`."""
    try:
        arr = np.asarray(tokens)
    except OverflowError:
        raise ShardError(f"cannot write {path}: a token id does not fit 64 bits") from None
    if arr.size == 0:
        arr = arr.astype(np.int64)  # np.asarray([]) is float64
    if arr.ndim != 1:
        raise ShardError(f"cannot write {path}: tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ShardError(f"cannot write {path}: token ids must be integers, got dtype {arr.dtype}")
    if len(arr) > _MAX_COUNT:
        raise ShardError(f"cannot write {path}: {len(arr)} tokens exceed the int32 header count; split the shard")
    return arr


def _choose_dtype(path: str, arr: np.ndarray, dtype) -> tuple[np.dtype, int]:
    """(token dtype, header version): uint16 / version 1 unless an id needs uint32 / version 2."""
    low, high = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    if low < 0:
        pos = int(np.argmax(arr < 0))
        raise ShardError(f"cannot write {path}: negative token id {low} (first at position {pos})")
    if dtype is None:
        dtype = np.uint16 if high < 2**16 else np.uint32
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise ShardError(
            f"cannot write {path}: dtype must be uint16 or uint32 (or None: chosen by the ids), got {dtype}"
        )
    if high > np.iinfo(dtype).max:
        hint = "; pass dtype=None or np.uint32" if dtype == np.uint16 else ""
        raise ShardError(f"cannot write {path}: token id {high} does not fit {dtype}{hint}")
    return dtype.newbyteorder("<"), 1 if dtype == np.uint16 else 2


def write_shard(path: str, tokens: np.ndarray | Sequence[int], *, dtype=None) -> int:
    """Write `tokens` as an llm.c shard at `path` (local path or fsspec URL); return the token count.

    uint16 (version 1, llm.c-compatible) unless an id is >= 65536 or `dtype=np.uint32` is given,
    then uint32 (version 2). The file is written as `<path>.tmp` and renamed, so `path` appears
    only once complete and a crash never leaves a half-written shard under the real name.
    """
    arr = _token_array(path, tokens)
    token_dtype, version = _choose_dtype(path, arr, dtype)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC_GPT2, version, len(arr))

    fs, fspath = url_to_fs(path, "shard")
    if isinstance(fs, LocalFileSystem):  # object stores have no directories to create
        fs.makedirs(fs._parent(fspath), exist_ok=True)
    tmp = fspath + ".tmp"
    try:
        with fs.open(tmp, "wb") as f:
            f.write(header.tobytes())
            for start in range(0, len(arr), _WRITE_CHUNK):
                f.write(arr[start : start + _WRITE_CHUNK].astype(token_dtype).tobytes())
        fs.mv(tmp, fspath)
    except BaseException:
        _remove_quietly(fs, tmp)
        raise
    return len(arr)


def _remove_quietly(fs, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path)
    except Exception:
        pass  # the original error matters more than a leftover .tmp


# ---------------------------------------------------------------------------------------- reading


def _has_magic(fs, pattern: str) -> bool:
    """Whether `pattern` is a glob; in a URL "?" starts the query (fsspec's HTTP glob agrees)."""
    return any(c in pattern for c in ("*[" if is_http(fs) else "*?["))


def _expand(pattern: str) -> list[tuple[object, str, str, int | None]]:
    """The files `pattern` names, sorted by name: (filesystem, fs path, URL, size or None where unknown)."""
    fs, fspath = url_to_fs(pattern, "shard pattern")
    local = isinstance(fs, LocalFileSystem)
    is_glob = _has_magic(fs, fspath) and not _remote(fs, pattern, "looking it up", lambda: fs.isfile(fspath))
    if is_glob:  # a file named with "[" is still just a file
        found = _remote(fs, pattern, "listing the matching shards", lambda: _glob(fs, fspath))
        files = [(p, _size(info)) for p, info in sorted(found.items()) if info.get("type") != "directory"]
        if not files:
            raise ShardError(f"no shard matches {pattern!r}: check the path and the glob pattern")
    else:
        try:
            files = [(fspath, _file_size(fs, fspath, pattern))]
        except ShardError as e:
            raise ShardError(f"no shard matches {pattern!r}: {e}") from None
    return [(fs, p, p if local else fs.unstrip_protocol(p), size) for p, size in files]


def _glob(fs, fspath: str) -> dict:
    """fs.glob, where HTTP raises listing failures: fsspec's walk drops a folder it cannot list, and an
    HTTP server that is down would look like no match (an index page that is not there still is one)."""
    if not is_http(fs):
        return fs.glob(fspath, detail=True)
    try:
        return fs.glob(fspath, detail=True, on_error="raise")
    except FileNotFoundError as e:
        if is_transient(e) or http_status(e) not in (None, 404):
            raise
        return {}


def _size(info: dict) -> int | None:
    return None if info.get("size") is None else int(info["size"])  # an HTTP index page lists no sizes


def _read_headers(files: list[tuple[object, str, str, int | None]]) -> list[ShardHeader]:
    """Headers of `files` (all on one filesystem), fetched in one batch: concurrent on remote stores."""
    fs = files[0][0]
    readable = [p for _, p, _, size in files if size is None or size >= HEADER_BYTES]
    if readable:
        check_range_support(fs, readable[0], files[0][2])  # before a batch that would download whole files

        def batch():
            return fs.cat_ranges(readable, [0] * len(readable), [HEADER_BYTES] * len(readable), on_error="raise")

        raws = _remote(fs, files[0][2], f"reading the headers of {len(readable)} shard(s)", batch)
    raw_of = dict(zip(readable, raws)) if readable else {}
    return [_parse_header(url, raw_of.get(p, b""), size) for _, p, url, size in files]


class BinShards:
    """llm.c token shards as a random-access window source (see the module docstring).

    Args:
        pattern: a path, a glob (``data/fineweb/*_train_*.bin``) or any fsspec URL or URL glob
            (``s3://bucket/x/train_*.bin``), or a list of them. Each pattern's files are sorted by
            name; a list keeps its order (a file named twice is read once).
        vocab_size: if given, a window holding an id >= vocab_size raises ShardError: the shards
            were tokenized for another vocabulary.

    Only headers are read here. Picklable: the state holds no open files or memory maps; each
    process opens them on first use (DataLoader workers, forked or spawned).
    """

    def __init__(self, pattern: str | list[str], *, vocab_size: int | None = None) -> None:
        patterns = [pattern] if isinstance(pattern, (str, os.PathLike)) else list(pattern)
        if not patterns:
            raise ShardError("empty dataset: no shard pattern given")
        if vocab_size is not None and int(vocab_size) < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.pattern = [str(p) for p in patterns] if len(patterns) > 1 else str(patterns[0])
        self.vocab_size = None if vocab_size is None else int(vocab_size)

        self._fs, self._paths, self.headers = [], [], []
        seen: set[str] = set()
        for p in patterns:
            files = [f for f in _expand(str(p)) if f[2] not in seen]
            seen.update(f[2] for f in files)
            if files:
                self._fs += [f[0] for f in files]
                self._paths += [f[1] for f in files]
                self.headers += _read_headers(files)
        counts = np.array([h.num_tokens for h in self.headers], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.num_tokens = int(counts.sum())
        if self.num_tokens == 0:
            raise ShardError(
                f"empty dataset: the {len(self.headers)} shard(s) matching {self.pattern!r} hold no tokens"
            )
        self._reset_open_files()

    # ------------------------------------------------------------------ public API

    @property
    def shards(self) -> list[str]:
        """Shard paths (local) or URLs (remote), in stream order."""
        return [h.path for h in self.headers]

    def is_remote(self, k: int) -> bool:
        """Whether shard `k` is read over the network (any fsspec store but the local disk)."""
        return not isinstance(self._fs[k], LocalFileSystem)

    def read_tokens(self, k: int, offset: int, n: int) -> np.ndarray:
        """Tokens ``[offset, offset + n)`` of shard `k` in its dtype, unchecked: for scans of whole shards.

        Remote: one ranged read (retried), past the open files, so a scan's large reads neither evict
        nor fill the read-ahead buffers that training reads use."""
        if not self.is_remote(k):
            return self._read(k, offset, n)
        self._own_files()
        h, fs, path = self.headers[k], self._fs[k], self._paths[k]
        start = h.header_bytes + offset * h.dtype.itemsize
        nbytes = n * h.dtype.itemsize
        data = retrying(
            h.path, f"reading {n} tokens at token {offset}", lambda: fs.cat_file(path, start, start + nbytes)
        )
        if len(data) != nbytes:
            raise ShardError(f"{h.path}: read {len(data)} of {nbytes} bytes at token {offset}; the shard was truncated")
        return np.frombuffer(data, dtype=h.dtype)

    def fingerprint(self, k: int) -> dict:
        """What identifies the current content of shard `k`: its size and modification time (local), or its
        size and the store's version fields (ETag, Last-Modified, generation, ...)."""
        fs, path, h = self._fs[k], self._paths[k], self.headers[k]
        if not self.is_remote(k):
            st = os.stat(path)
            return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        info = retrying(h.path, "looking it up", lambda: fs.info(path))
        versions = {key: str(info[key]) for key in _VERSION_FIELDS if info.get(key) is not None}
        return {"url": redact_url(h.path), "size": info.get("size") or h.file_bytes, **versions}

    def num_windows(self, length: int) -> int:
        """Windows of `length` tokens per epoch (consecutive windows share one token)."""
        if length < 2:
            raise ValueError(f"window length must be >= 2 (a token and its label), got {length}")
        return (self.num_tokens - 1) // (length - 1)

    def window(self, index: int, length: int) -> np.ndarray:
        """Window `index`: int64 tokens ``[s, s + length)`` of the stream, ``s = (index mod E) * (length - 1)``."""
        index, length = int(index), int(length)
        if index < 0:
            raise ValueError(f"window index must be >= 0, got {index}")
        per_epoch = self.num_windows(length)
        if per_epoch == 0:
            raise ShardError(
                f"{self.pattern!r} holds {self.num_tokens} tokens, fewer than one window of {length}; "
                f"use more data or a shorter training.seq_len"
            )
        start = (index % per_epoch) * (length - 1)
        out = np.empty(length, dtype=np.int64)
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        filled = 0
        while filled < length:  # ends inside the stream: start + length <= num_tokens
            offset = start + filled - int(self._starts[k])
            n = min(length - filled, self.headers[k].num_tokens - offset)
            if n > 0:  # empty shards contribute nothing
                piece = self._read(k, offset, n)
                self._check_vocab(k, piece, offset)
                out[filled : filled + n] = piece
                filled += n
            k += 1
        return out

    def close(self) -> None:
        """Close open remote files and drop memory maps (they reopen on the next read)."""
        for handle in self._remote.values():
            handle.close()
        self._reset_open_files()

    def __repr__(self) -> str:
        dtypes = "/".join(sorted({str(h.dtype.newbyteorder("=")) for h in self.headers}))
        return redact_text(  # a repr is printed and logged: no credential in a URL
            f"BinShards({self.pattern!r}: {len(self.headers)} shards, {self.num_tokens:,} tokens, {dtypes}, "
            f"vocab_size={self.vocab_size})"
        )

    # ------------------------------------------------------------------ pickling: no open files

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_memmaps", "_remote", "_lock", "_pid"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_open_files()

    def _own_files(self) -> None:
        """In a forked worker: new file objects, and new remote filesystems (an async one's event loop
        belongs to the parent: fsspec refuses to use it after a fork); fsspec's instance cache, keyed by
        process, makes each anew from its arguments."""
        if self._pid == os.getpid():
            return
        self._reset_open_files()
        self._fs = [
            fs if isinstance(fs, LocalFileSystem) else type(fs)(*fs.storage_args, **fs.storage_options)
            for fs in self._fs
        ]

    def _reset_open_files(self) -> None:
        self._memmaps: dict[int, np.memmap] = {}
        self._remote: OrderedDict[int, object] = OrderedDict()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    # ------------------------------------------------------------------ reading

    def _read(self, k: int, offset: int, n: int) -> np.ndarray:
        """Tokens ``[offset, offset + n)`` of shard `k`, in the shard's dtype."""
        self._own_files()
        if isinstance(self._fs[k], LocalFileSystem):
            return self._memmap(k)[offset : offset + n]
        return self._read_remote(k, offset, n)

    def _memmap(self, k: int) -> np.memmap:
        mm = self._memmaps.get(k)
        if mm is None:
            h = self.headers[k]
            mm = np.memmap(self._paths[k], dtype=h.dtype, mode="r", offset=h.header_bytes, shape=(h.num_tokens,))
            self._memmaps[k] = mm
        return mm

    def _read_remote(self, k: int, offset: int, n: int) -> np.ndarray:
        h = self.headers[k]
        nbytes = n * h.dtype.itemsize

        def attempt() -> bytes:
            with self._lock:  # an open file has one position: serialise seek + read
                handle = self._remote_file(k)
                handle.seek(h.header_bytes + offset * h.dtype.itemsize)
                return handle.read(nbytes)

        # A long run must not die on one failed read: transient failures are retried (data.remote).
        data = retrying(h.path, f"reading {n} tokens at token {offset}", attempt, on_retry=lambda: self._drop(k))
        if len(data) != nbytes:
            raise ShardError(
                f"{h.path}: read {len(data)} of {nbytes} bytes at token {offset}; "
                f"the shard changed or was truncated after the run started"
            )
        return np.frombuffer(data, dtype=h.dtype)

    def _remote_file(self, k: int):
        """Open file for shard `k` from a small LRU cache (each holds a read-ahead buffer)."""
        handle = self._remote.pop(k, None)
        if handle is None:
            fs = self._fs[k]
            # HTTP: the size from the header, so opening sends no HEAD request (nor needs one to work)
            size = {"size": self.headers[k].file_bytes} if is_http(fs) else {}
            handle = fs.open(self._paths[k], "rb", block_size=_REMOTE_BLOCK, cache_type="readahead", **size)
            while len(self._remote) >= _MAX_OPEN_REMOTE:
                self._remote.popitem(last=False)[1].close()
        self._remote[k] = handle  # most recently used last
        return handle

    def _drop(self, k: int) -> None:
        """Forget shard `k`'s open file after a failed read: its buffer and position are unknown."""
        with self._lock:
            handle = self._remote.pop(k, None)
        if handle is not None:
            try:
                handle.close()
            except Exception:
                pass  # the connection is already broken; the next read opens a new one

    def _check_vocab(self, k: int, piece: np.ndarray, offset: int) -> None:
        if self.vocab_size is None or int(piece.max()) < self.vocab_size:
            return
        pos = int(np.argmax(piece >= self.vocab_size))
        raise ShardError(
            f"token id {int(piece[pos])} in {self.headers[k].path} (token {offset + pos}) is >= model.vocab_size "
            f"{self.vocab_size}: the shards were made with a different tokenizer; re-tokenize them or raise "
            f"model.vocab_size"
        )
