"""The token-id range check: every id in the training shards is < model.vocab_size, before step 1.

A window's ids are also checked as it is read (BinShards.window), but a bad id deep in a shard would
then stop a run hours in. This check reads every shard once, in chunks (numpy max over the memory map
locally, 16 MiB ranged reads remotely), and fails with a ShardError (exit 2) naming the shard, the
token position and the id.

Remote shards are scanned too: the check reads them whole, once, with a progress line per shard
(rank 0), and remembers the result; a run that trains over the data reads it anyway. Under torchrun
the shards are split over the ranks (shard k is checked by rank k mod world size), so each rank
reads its share only, and the ranks share what they found, so every rank exits 2 with the same message.

The result (a shard's largest id, so any vocab_size can use it) is cached per shard in
``$XDG_CACHE_HOME/atma_titan/token_ids/`` (default ``~/.cache/...``): one small JSON file per shard,
keyed by the shard's resolved path, size and modification time (local) or its redacted URL, size and
the store's version fields: ETag, Last-Modified, generation (remote). A rewritten shard gets a new
key and is scanned again. Not next to the shards: data folders are often read-only or shared, a
bucket is not ours to write to, and a sidecar file could match the data glob itself. Local shards
under CACHE_MIN_LOCAL_TOKENS are not cached: scanning them is as fast as reading a cache entry.
An unwritable cache folder only means the scan is repeated next time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from atma_titan.utils.atomic import write_json_atomic
from atma_titan.data.shards import BinShards, ShardError
from atma_titan.utils.redact import redact_url

__all__ = ["CACHE_MIN_LOCAL_TOKENS", "RangeCheck", "cache_dir", "check_token_ids"]

# A local scan of 16M tokens (32 MiB of uint16) takes ~10 ms, about what a cache lookup costs.
CACHE_MIN_LOCAL_TOKENS = 1 << 24
_SCAN_CHUNK = 1 << 23  # tokens per read: bounded memory, and one ranged request per chunk remotely


def cache_dir() -> Path:
    """Where the per-shard results live: $XDG_CACHE_HOME/atma_titan/token_ids (default ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "atma_titan" / "token_ids"


@dataclass(frozen=True)
class RangeCheck:
    """What one rank's check did: shards checked, of which read in full, and of which taken from the cache."""

    checked: int
    scanned: int
    cached: int


def check_token_ids(
    shards: BinShards, vocab_size: int, *, rank: int | None = None, world_size: int | None = None
) -> RangeCheck:
    """Raise ShardError unless every token id of this rank's share of `shards` is < `vocab_size`.

    `rank` / `world_size`: the share (shard k belongs to rank k mod world_size); by default the
    torch.distributed process group's, or all shards without one.
    """
    collective = rank is None and world_size is None
    rank, world_size = _rank_share(rank, world_size)
    mine = [k for k, h in enumerate(shards.headers) if k % world_size == rank and h.num_tokens > 0]
    remote = [k for k in mine if shards.is_remote(k)]
    scanned = cached = 0
    problem = None
    for k in mine:
        use_cache = shards.is_remote(k) or shards.headers[k].num_tokens >= CACHE_MIN_LOCAL_TOKENS
        key = shards.fingerprint(k) if use_cache else None
        max_id = _load(key) if use_cache else None
        if max_id is None:
            if k in remote and rank == 0:
                h = shards.headers[k]
                size = h.file_bytes / 2**20
                print(
                    f"checking the token ids of {redact_url(h.path)} ({remote.index(k) + 1}/{len(remote)} remote "
                    f"shards, {size:,.1f} MiB; once, then cached in {cache_dir()})",
                    flush=True,
                )
            max_id = _max_id(shards, k)
            scanned += 1
            if use_cache:
                _store(key, max_id)
        else:
            cached += 1
        found = _first_out_of_range(shards, k, vocab_size) if max_id >= vocab_size else None
        if found is not None:
            position, value = found
            problem = (
                f"token id {value} at token {position:,} of {shards.headers[k].path} is >= model.vocab_size "
                f"{vocab_size} (found before training by the token-id check): the shards were made with a "
                f"different tokenizer or are corrupt; re-tokenize them or raise model.vocab_size"
            )
            break
    if collective:  # every rank raises the same error, so all exit 2 together
        from atma_titan.parallel.dims import all_gather_objects

        problem = next((p for p in all_gather_objects(problem) if p is not None), None)
    if problem is not None:
        raise ShardError(problem)
    return RangeCheck(checked=len(mine), scanned=scanned, cached=cached)


def _rank_share(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _chunks(shards: BinShards, k: int):
    n = shards.headers[k].num_tokens
    for start in range(0, n, _SCAN_CHUNK):
        yield start, shards.read_tokens(k, start, min(_SCAN_CHUNK, n - start))


def _max_id(shards: BinShards, k: int) -> int:
    """The largest token id in shard `k` (the scan)."""
    return max(int(chunk.max()) for _, chunk in _chunks(shards, k))


def _first_out_of_range(shards: BinShards, k: int, vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first id >= vocab_size in shard `k` (a second scan, on the failure path only);
    None if there is none after all (a cache entry outlived its shard's content)."""
    for start, chunk in _chunks(shards, k):
        bad = np.flatnonzero(chunk >= vocab_size)
        if bad.size:
            return start + int(bad[0]), int(chunk[bad[0]])
    return None


# ---------------------------------------------------------------------------------------- cache


def _entry_path(key: dict) -> Path:
    return cache_dir() / f"{xxhash.xxh64_hexdigest(json.dumps(key, sort_keys=True).encode())}.json"


def _load(key: dict) -> int | None:
    try:
        entry = json.loads(_entry_path(key).read_text())
    except (OSError, ValueError):
        return None  # no entry yet, or an unreadable one: scan
    if entry.get("key") != key or not isinstance(entry.get("max_id"), int):
        return None
    return entry["max_id"]


def _store(key: dict, max_id: int) -> None:
    path = _entry_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"key": key, "max_id": max_id})
    except OSError:
        pass  # a read-only home: the check still ran, it is only repeated next time
