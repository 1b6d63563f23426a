"""Tests for llm.c token shards: header checks, the writer, and the BinShards window source."""

from __future__ import annotations

import pickle
import time
import uuid

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from atma_titan.data.shards import HEADER_BYTES, BinShards, ShardError, read_header, write_shard


# ---------------------------------------------------------------- helpers


def raw_shard(path, tokens, magic=20240520, version=1, count=None, dtype="<u2", header_ints=256):
    """Write a shard byte by byte, independently of write_shard (for odd or foreign layouts)."""
    header = np.zeros(header_ints, dtype="<i4")
    header[:3] = (magic, version, len(tokens) if count is None else count)
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes())
    return str(path)


def make_shards(folder, sizes, seed=0, high=50257):
    """Shards train_000.bin, ... of the given sizes; returns (glob pattern, concatenated tokens)."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, high, size=n) for n in sizes]
    for i, part in enumerate(parts):
        write_shard(str(folder / f"train_{i:03d}.bin"), part)
    return str(folder / "train_*.bin"), np.concatenate(parts)


@pytest.fixture
def memdir():
    """A fresh memory:// folder, removed afterwards (the memory filesystem is process-global)."""
    root = f"memory://shards-{uuid.uuid4().hex}"
    yield root
    fs = MemoryFileSystem()
    if fs.exists(root):
        fs.rm(root, recursive=True)


# ---------------------------------------------------------------- writing and headers


def test_round_trip_uint16(tmp_path):
    tokens = np.array([50256, 0, 1, 65535, 42], dtype=np.int64)
    path = str(tmp_path / "a.bin")
    assert write_shard(path, tokens) == 5
    header = read_header(path)
    assert (header.version, header.num_tokens, header.dtype, header.header_bytes) == (1, 5, np.uint16, 1024)
    assert (tmp_path / "a.bin").stat().st_size == HEADER_BYTES + 5 * 2
    raw = np.fromfile(path, dtype="<i4", count=3)
    assert raw.tolist() == [20240520, 1, 5]  # exactly llm.c's GPT-2 header
    assert np.array_equal(BinShards(path).window(0, 5), tokens)


def test_round_trip_uint32_chosen_by_the_ids(tmp_path):
    tokens = [128000, 65536, 3, 0]  # a plain list; 65536 needs uint32
    path = str(tmp_path / "b.bin")
    assert write_shard(path, tokens) == 4
    header = read_header(path)
    assert (header.version, header.dtype) == (2, np.uint32)
    assert np.array_equal(BinShards(path).window(0, 4), tokens)
    forced = str(tmp_path / "c.bin")
    write_shard(forced, [1, 2, 3], dtype=np.uint32)
    assert read_header(forced).version == 2 and BinShards(forced).window(0, 3).tolist() == [1, 2, 3]


def test_reads_llama3_layout(tmp_path):
    tokens = [128000, 9906, 1917, 128001, 0]
    path = raw_shard(tmp_path / "llama.bin", tokens, magic=20240801, version=7, dtype="<u4")
    header = read_header(path)
    assert (header.version, header.num_tokens, header.dtype) == (7, 5, np.uint32)
    assert BinShards(path, vocab_size=128256).window(0, 5).tolist() == tokens


def test_write_rejects_bad_ids(tmp_path):
    path = str(tmp_path / "bad.bin")
    with pytest.raises(ShardError, match=r"bad\.bin.*negative token id -1"):
        write_shard(path, [1, -1, 2])
    with pytest.raises(ShardError, match=r"bad\.bin.*token id 70000 does not fit uint16"):
        write_shard(path, [70000], dtype=np.uint16)
    with pytest.raises(ShardError, match=r"does not fit uint32"):
        write_shard(path, np.array([2**32], dtype=np.int64))
    with pytest.raises(ShardError, match="must be integers"):
        write_shard(path, np.array([1.0, 2.0]))
    assert not list(tmp_path.iterdir())  # nothing written, not even a .tmp


def test_write_empty_shard_has_a_valid_header(tmp_path):
    path = str(tmp_path / "empty.bin")
    assert write_shard(path, []) == 0
    assert read_header(path).num_tokens == 0


@pytest.mark.parametrize(
    "make, problem",
    [
        (
            lambda p: raw_shard(p, [1, 2, 3], magic=12345),
            r"bad magic 12345 \(expected 20240520.*not an llm\.c token shard",
        ),
        (lambda p: raw_shard(p, [1, 2, 3], version=9), r"unknown shard version 9"),
        (lambda p: raw_shard(p, [1, 2, 3], magic=20240801, version=1), r"unknown shard version 1 for magic 20240801"),
        (lambda p: raw_shard(p, [1, 2, 3], count=10), r"truncated.*says 10 tokens.*room for 3 tokens"),
        (lambda p: raw_shard(p, [1, 2, 3], count=2), r"longer than its header says.*2 tokens.*room for 3 tokens"),
        (lambda p: raw_shard(p, [], header_ints=10), r"40 bytes, shorter than the 1024-byte llm\.c header"),
        (lambda p: str(p), r"not found"),  # never written
    ],
    ids=["magic", "version", "llama3-version", "truncated", "too-long", "too-short", "missing"],
)
def test_header_errors_name_the_file_and_the_problem(tmp_path, make, problem):
    path = make(tmp_path / "shard_017.bin")
    for read in (read_header, BinShards):
        with pytest.raises(ShardError, match=problem) as err:
            read(path)
        assert "shard_017.bin" in str(err.value)


def test_write_is_atomic(memdir, monkeypatch):
    url = f"{memdir}/train_000.bin"
    fs, target = fsspec.core.url_to_fs(url)
    moves = []
    real_mv = MemoryFileSystem.mv

    def spy_mv(self, src, dst, *args, **kwargs):
        # At the rename the whole shard sits under the .tmp name and nothing under the real one.
        moves.append((src, dst, self.exists(dst), self.size(src)))
        return real_mv(self, src, dst, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "mv", spy_mv)
    write_shard(url, np.arange(1000))
    assert moves == [(target + ".tmp", target, False, HEADER_BYTES + 2000)]
    assert fs.exists(target) and not fs.exists(target + ".tmp")
    assert read_header(url).num_tokens == 1000

    def failing_mv(self, src, dst, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(MemoryFileSystem, "mv", failing_mv)
    with pytest.raises(OSError, match="disk full"):
        write_shard(f"{memdir}/train_001.bin", np.arange(10))
    assert not fs.exists(f"{memdir}/train_001.bin") and not fs.exists(f"{memdir}/train_001.bin.tmp")


# ---------------------------------------------------------------- windows


def test_windows_across_shard_boundaries_equal_slicing_the_concatenation(tmp_path):
    pattern, stream = make_shards(tmp_path, [100, 7, 0, 250, 33])  # a tiny and an empty shard too
    source = BinShards(pattern)
    assert source.num_tokens == len(stream) == 390
    assert [s.rsplit("/", 1)[-1] for s in source.shards] == [f"train_{i:03d}.bin" for i in range(5)]
    for length in (2, 9, 50, 129, 390):
        assert source.num_windows(length) == 389 // (length - 1)
        for i in range(source.num_windows(length)):
            start = i * (length - 1)
            window = source.window(i, length)
            assert window.dtype == np.int64 and window.shape == (length,)
            assert np.array_equal(window, stream[start : start + length])


def test_every_token_is_a_label_once_per_epoch(tmp_path):
    pattern, stream = make_shards(tmp_path, [40, 41])
    source = BinShards(pattern)
    length = 9
    labels = np.concatenate([source.window(i, length)[1:] for i in range(source.num_windows(length))])
    assert np.array_equal(labels, stream[1 : 1 + len(labels)])  # 80 labels: all but the first token


def test_wrap_around(tmp_path):
    pattern, stream = make_shards(tmp_path, [60, 45])  # 105 tokens
    source = BinShards(pattern)
    length = 17
    per_epoch = source.num_windows(length)
    assert per_epoch == 104 // 16 == 6  # the 8-token tail never starts a window
    for i in range(per_epoch):
        for epoch in (1, 2, 1000):
            assert np.array_equal(source.window(epoch * per_epoch + i, length), source.window(i, length))
    with pytest.raises(ShardError, match="fewer than one window of 200"):
        source.window(0, 200)


def test_windows_are_deterministic_and_independent_of_order(tmp_path):
    pattern, _ = make_shards(tmp_path, [500, 500, 500])
    a, b = BinShards(pattern), BinShards(pattern)
    order = np.random.default_rng(1).permutation(200)
    first = {int(i): a.window(int(i), 33) for i in order}
    assert all(np.array_equal(b.window(i, 33), first[i]) for i in range(200))
    assert all(np.array_equal(a.window(i, 33), first[i]) for i in range(200))


def test_list_of_patterns_keeps_its_order_and_reads_a_file_once(tmp_path):
    write_shard(str(tmp_path / "b.bin"), [1, 2, 3])
    write_shard(str(tmp_path / "a.bin"), [4, 5, 6])
    source = BinShards([str(tmp_path / "b.bin"), str(tmp_path / "*.bin")])
    assert source.window(0, 6).tolist() == [1, 2, 3, 4, 5, 6]
    assert len(source.shards) == 2 and "2 shards, 6 tokens, uint16" in repr(source)


def test_no_match_and_empty_dataset(tmp_path, memdir):
    with pytest.raises(ShardError, match=r"no shard matches .*nothing_\*\.bin"):
        BinShards(str(tmp_path / "nothing_*.bin"))
    with pytest.raises(ShardError, match=r"no shard matches .*absent\.bin.*not found"):
        BinShards(str(tmp_path / "absent.bin"))
    with pytest.raises(ShardError, match=r"no shard matches .*memory://.*train_\*\.bin"):
        BinShards(f"{memdir}/train_*.bin")
    write_shard(str(tmp_path / "e0.bin"), [])
    write_shard(str(tmp_path / "e1.bin"), [])
    with pytest.raises(ShardError, match="empty dataset"):
        BinShards(str(tmp_path / "e*.bin"))


def test_vocab_check_names_the_shard_and_the_id(tmp_path):
    write_shard(str(tmp_path / "train_000.bin"), [50256, 1, 2, 3])
    write_shard(str(tmp_path / "train_001.bin"), [4, 50300, 6, 7])
    source = BinShards(str(tmp_path / "train_*.bin"), vocab_size=50257)
    assert source.window(0, 4).tolist() == [50256, 1, 2, 3]  # clean windows still read
    with pytest.raises(ShardError) as err:
        source.window(1, 4)  # tokens 3..6 cross into train_001.bin
    message = str(err.value)
    assert "token id 50300 in " in message and "train_001.bin" in message
    assert "model.vocab_size 50257" in message and "different tokenizer" in message


def test_pickled_source_reads_the_same_windows(tmp_path):
    pattern, _ = make_shards(tmp_path, [300, 300])
    source = BinShards(pattern, vocab_size=50257)
    expected = [source.window(i, 65) for i in range(9)]  # opens the memory maps
    assert source._memmaps  # ... which pickling must leave behind
    copy = pickle.loads(pickle.dumps(source))
    assert not copy._memmaps and copy.shards == source.shards and copy.vocab_size == 50257
    assert all(np.array_equal(copy.window(i, 65), expected[i]) for i in range(9))


def test_works_in_dataloader_workers(tmp_path):
    from atma_titan.data.loader import build_dataloader

    pattern, _ = make_shards(tmp_path, [2000, 2000])
    source = BinShards(pattern, vocab_size=50257)
    plain, workers = build_dataloader(source, 32, 8, 4), build_dataloader(source, 32, 8, 4, num_workers=2)
    for (x0, y0), (x1, y1) in zip(plain, workers):
        assert (x0 == x1).all() and (y0 == y1).all()
        break


def test_memory_url_source_equals_local_source(tmp_path, memdir):
    sizes = [333, 1000, 1]
    pattern, stream = make_shards(tmp_path, sizes)
    for i, part in enumerate(np.split(stream, np.cumsum(sizes)[:-1])):
        write_shard(f"{memdir}/train_{i:03d}.bin", part)
    write_shard(f"{memdir}/other.bin", [1, 2, 3])  # not matched by the glob
    local, remote = BinShards(pattern), BinShards(f"{memdir}/train_*.bin")
    assert remote.num_tokens == local.num_tokens and all(s.startswith("memory://") for s in remote.shards)
    for i in np.random.default_rng(3).integers(0, 10_000, size=200):
        assert np.array_equal(remote.window(int(i), 129), local.window(int(i), 129))
    copy = pickle.loads(pickle.dumps(remote))  # open remote files are not pickled either
    assert np.array_equal(copy.window(5, 129), local.window(5, 129))


def test_random_windows_are_fast(tmp_path):
    path = str(tmp_path / "big.bin")
    write_shard(path, np.random.default_rng(0).integers(0, 50257, size=5_000_000))
    source = BinShards(path, vocab_size=50257)
    indices = np.random.default_rng(1).integers(0, source.num_windows(2049), size=1000)
    t0 = time.perf_counter()
    for i in indices:
        source.window(int(i), 2049)
    assert time.perf_counter() - t0 < 0.5
