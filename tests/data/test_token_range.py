"""The token-id range check before training: a bad id deep in a shard fails at the start (exit 2,
naming shard and position), and the per-shard cache spares a restart the scan."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from helpers import SMALL

import atma_titan.data.token_range as token_range
from atma_titan.config import load_config
from atma_titan.data import TrainData
from atma_titan.data.shards import BinShards, ShardError, write_shard
from atma_titan.data.token_range import cache_dir, check_token_ids
from atma_titan.train import main

RUN = [*SMALL, "--metrics.stdout", "false", "--data.source", "bin"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def scans(monkeypatch):
    """Counts the shards the check reads in full."""
    counted = []
    scan = token_range._max_id

    def counting(shards, k):
        counted.append(shards.shards[k])
        return scan(shards, k)

    monkeypatch.setattr(token_range, "_max_id", counting)
    return counted


def clean_shards(folder, sizes, high=512):
    rng = np.random.default_rng(0)
    for i, n in enumerate(sizes):
        write_shard(str(folder / f"train_{i:03d}.bin"), rng.integers(0, high, size=n))
    return str(folder / "train_*.bin")


def test_a_late_bad_id_exits_2_before_step_1(tmp_path, capsys):
    pattern = clean_shards(tmp_path, [20_000, 20_000])
    tokens = np.random.default_rng(1).integers(0, 512, size=20_000)
    tokens[15_000] = 600  # the debug model's vocabulary is 512; 3 steps read far fewer than 15,000 tokens
    write_shard(str(tmp_path / "train_001.bin"), tokens)
    run = tmp_path / "run"
    code = main([*RUN, "--data.path", pattern, "--job.dump_folder", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "token id 600 at token 15,000 of " in err and "train_001.bin" in err and "model.vocab_size 512" in err
    assert not (run / "metrics.jsonl").exists() or '"step"' not in (run / "metrics.jsonl").read_text()


def test_the_check_names_the_first_bad_id(tmp_path):
    pattern = clean_shards(tmp_path, [3000, 3000])
    source = BinShards(pattern, vocab_size=512)
    assert check_token_ids(source, 512) == token_range.RangeCheck(checked=2, scanned=2, cached=0)
    with pytest.raises(ShardError, match=r"token id \d+ at token \d+ of .*train_000\.bin is >= model\.vocab_size 100"):
        check_token_ids(source, 100)


def test_a_restart_uses_the_cache(tmp_path, monkeypatch, scans):
    monkeypatch.setattr(token_range, "CACHE_MIN_LOCAL_TOKENS", 0)  # cache the small test shards too
    pattern = clean_shards(tmp_path / "data", [4000, 4000, 4000])
    cfg = load_config([*RUN, "--data.path", pattern]).data
    TrainData(cfg, 512)  # the first run scans every shard ...
    assert len(scans) == 3 and len(list(cache_dir().glob("*.json"))) == 3
    stamps = {p: p.stat().st_mtime_ns for p in cache_dir().glob("*.json")}
    TrainData(cfg, 512)  # ... a restart reads the cache
    assert len(scans) == 3 and {p: p.stat().st_mtime_ns for p in cache_dir().glob("*.json")} == stamps
    # The cached maximum serves another vocabulary too, and a bad one still fails by name.
    with pytest.raises(ShardError, match=r"train_000\.bin"):
        check_token_ids(BinShards(pattern), 300)
    assert len(scans) == 3
    # A rewritten shard (new mtime) is scanned again; the others are not.
    changed = tmp_path / "data" / "train_001.bin"
    write_shard(str(changed), np.arange(4000) % 512)
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 10**9))
    TrainData(cfg, 512)
    assert len(scans) == 4 and scans[-1].endswith("train_001.bin")


def test_small_local_shards_are_not_cached(tmp_path, scans):
    source = BinShards(clean_shards(tmp_path, [1000]))
    check_token_ids(source, 512)
    check_token_ids(source, 512)
    assert len(scans) == 2 and not cache_dir().exists()


def test_remote_shards_are_scanned_once_with_a_progress_line(tmp_path, scans, capsys):
    root = f"memory://token-range-{uuid.uuid4().hex}"
    try:
        write_shard(f"{root}/train_000.bin", np.arange(3000) % 512)
        write_shard(f"{root}/train_001.bin", np.arange(3000) % 512)
        source = BinShards(f"{root}/train_*.bin")
        assert check_token_ids(source, 512).scanned == 2
        out = capsys.readouterr().out
        assert "checking the token ids of memory://" in out and "(2/2 remote shards" in out
        assert check_token_ids(source, 512).cached == 2 and len(scans) == 2
        assert capsys.readouterr().out == ""
    finally:
        MemoryFileSystem().rm(root, recursive=True)


def test_ranks_split_the_shards(tmp_path, scans, monkeypatch):
    import torch.distributed as dist

    source = BinShards(clean_shards(tmp_path, [500, 500, 500, 500, 500]))
    assert check_token_ids(source, 512, rank=1, world_size=2).checked == 2
    assert [s[-7:] for s in scans] == ["001.bin", "003.bin"]
    # By default the share is the process group's: rank 2 of 3 checks shard 2 only.
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda: 3)
    others: list = [None, None]  # what ranks 0 and 1 report

    def all_gather_object(out, obj):
        out[:] = [*others, obj]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    assert check_token_ids(source, 512).checked == 1 and scans[-1].endswith("002.bin")
    # a bad id found by another rank stops this one too, with the same message
    others[0] = "token id 900 at token 7 of shard_000.bin is >= model.vocab_size 512"
    with pytest.raises(ShardError, match="token id 900 at token 7 of shard_000.bin"):
        check_token_ids(source, 512)


def test_an_unwritable_cache_only_repeats_the_scan(tmp_path, monkeypatch, scans):
    monkeypatch.setattr(token_range, "CACHE_MIN_LOCAL_TOKENS", 0)
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    source = BinShards(clean_shards(tmp_path / "data", [500]))
    check_token_ids(source, 512)
    check_token_ids(source, 512)
    assert len(scans) == 2
