"""llm.c shards over HTTP (a loopback server with range requests, started by the tests) and memory://:
globs over an HTML index page, retries through a server restart, and the errors for a missing
fsspec back-end, a missing file, a forbidden one and a server without range requests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
from pathlib import Path

from fsspec.implementations.memory import MemoryFileSystem
from helpers import SMALL
from http_shards import ForbiddenHandler, NoRangeHandler, RangeHandler, Server, make_shards

import atma_titan.data.remote as remote
import atma_titan.data.shards as shards_module
from atma_titan.config import load_config
from atma_titan.data.remote import RemoteDataError
from atma_titan.data.shards import BinShards, ShardError, read_header, write_shard
from atma_titan.utils.errors import MissingExtraError
from atma_titan.train import main, train

pytest.importorskip("aiohttp")

CONFIG = Path(__file__).resolve().parents[2] / "train_configs" / "debug_model.toml"
RUN = [*SMALL, "--metrics.stdout", "false", "--data.source", "bin"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """The token-id check caches remote shards' results: keep them in the test's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def data(tmp_path):
    """Three shards under <tmp>/www/x, and their tokens."""
    folder = tmp_path / "www" / "x"
    folder.mkdir(parents=True)
    return folder, make_shards(folder, [3000, 5000, 2000])


@pytest.fixture
def server(data):
    srv = Server(data[0].parent)
    yield srv
    srv.stop()


def fast_retries(monkeypatch, delays=(0.3, 0.6, 1.2, 2.4)):
    monkeypatch.setattr(remote, "RETRY_DELAYS_S", delays)


# ---------------------------------------------------------------- reading


def test_http_glob_and_single_file_equal_the_local_shards(data, server):
    folder, stream = data
    remote_glob = BinShards(f"{server.url}/x/train_*.bin", vocab_size=512)  # the listing has no sizes
    assert remote_glob.shards == [f"{server.url}/x/train_{i:03d}.bin" for i in range(3)]
    local = BinShards(str(folder / "train_*.bin"))
    assert remote_glob.num_tokens == local.num_tokens == len(stream)
    for i in np.random.default_rng(0).integers(0, 2000, size=50):
        assert np.array_equal(remote_glob.window(int(i), 65), local.window(int(i), 65))
    single = BinShards(f"{server.url}/x/train_001.bin")
    assert single.num_tokens == 5000 and np.array_equal(single.window(0, 5000), stream[3000:8000])
    assert read_header(f"{server.url}/x/train_002.bin").num_tokens == 2000


def test_http_shards_in_dataloader_workers(server):
    from atma_titan.data.loader import build_dataloader

    source = BinShards(f"{server.url}/x/train_*.bin", vocab_size=512)
    plain, workers = build_dataloader(source, 32, 8, 4), build_dataloader(source, 32, 8, 4, num_workers=2)
    for (x0, y0), (x1, y1) in zip(plain, workers):  # the pickled filesystem works in a worker
        assert (x0 == x1).all() and (y0 == y1).all()
        break


def test_truncated_remote_shard_is_named_at_its_read(data, server):
    folder, _ = data
    source = BinShards(f"{server.url}/x/train_002.bin")  # a single file: HEAD gives the size, checked
    path = folder / "train_002.bin"
    path.write_bytes(path.read_bytes()[:2000])  # shrinks after the run started
    source.close()
    with pytest.raises(ShardError, match=r"train_002\.bin: read \d+ of \d+ bytes"):
        source.window(0, 2000)


# ---------------------------------------------------------------- transient failures: retries


def test_reads_survive_a_server_restart(data, server, monkeypatch, capsys):
    fast_retries(monkeypatch)
    source = BinShards(f"{server.url}/x/train_*.bin")
    expected = source.window(100, 65)
    source.close()
    server.stop()
    restart = threading.Timer(1.0, server.start)  # down for a second, back on the same port
    restart.start()
    try:
        assert np.array_equal(source.window(100, 65), expected)
    finally:
        restart.join()
    assert "retry 1 of 4" in capsys.readouterr().err


def test_a_server_that_stays_down_is_a_clear_error(data, server, monkeypatch):
    fast_retries(monkeypatch, delays=(0.1, 0.1))
    source = BinShards(f"{server.url}/x/train_*.bin")
    source.close()
    server.stop()
    with pytest.raises(RemoteDataError, match=r"train_000\.bin: reading 65 tokens at token 0 failed 3 times"):
        source.window(0, 65)
    with pytest.raises(RemoteDataError, match=r"listing the matching shards failed 3 times.*stays down"):
        BinShards(f"{server.url}/x/train_*.bin")


def test_a_stalled_server_times_out_and_is_retried(tmp_path, monkeypatch):
    import socket

    fast_retries(monkeypatch, delays=(0.1,))
    monkeypatch.setattr(remote, "HTTP_READ_TIMEOUT_S", 0.3)
    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteDataError, match=r"failed 2 times.*Timeout"):
            BinShards(f"http://127.0.0.1:{silent.getsockname()[1]}/x/train_000.bin")
        assert time.monotonic() - t0 < 10
    finally:
        silent.close()


@pytest.mark.slow
def test_training_survives_a_killed_and_restarted_server(tmp_path, data, server, monkeypatch, capsys):
    """The server dies while the loader reads (a dropped connection, then refused ones) and comes back."""
    fast_retries(monkeypatch)
    monkeypatch.setattr(shards_module, "_REMOTE_BLOCK", 256)  # a request every few windows
    killed = threading.Event()

    class Dying(RangeHandler):
        @staticmethod
        def on_request(handler, start):
            # Past the first windows (the construction's reads start at offsets 0, 8 and 1024): kill it once.
            if start is not None and start > 2048 and not killed.is_set():
                killed.set()
                threading.Thread(target=outage).start()
                return "drop"
            return None

    def outage():
        server.stop()
        time.sleep(1.5)
        server.start()

    server.stop()
    server.handler = Dying
    server.start()
    last = train(
        load_config(
            [*RUN, "--training.steps", "6", "--data.path", f"{server.url}/x/train_*.bin"]
            + ["--job.dump_folder", str(tmp_path / "run")]
        )
    )
    assert killed.is_set() and last["step"] == 6 and np.isfinite(last["loss"])
    assert "retry 1 of 4" in capsys.readouterr().err


@pytest.mark.slow
def test_train_command_on_http_shards(tmp_path, server):
    proc = subprocess.run(
        [sys.executable, "-m", "atma_titan.train", "--config", str(CONFIG), *RUN]
        + ["--data.path", f"{server.url}/x/train_*.bin", "--job.dump_folder", str(tmp_path / "run")]
        + ["--checkpoint.enable", "false"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


# ---------------------------------------------------------------- permanent failures: exit 2


def run_main(tmp_path, path, capsys):
    code = main([*RUN, "--data.path", path, "--job.dump_folder", str(tmp_path / "run")])
    return code, capsys.readouterr().err


def test_missing_file_exits_2_naming_the_url(tmp_path, server, capsys):
    code, err = run_main(tmp_path, f"{server.url}/x/absent.bin", capsys)
    assert code == 2 and f"{server.url}/x/absent.bin not found (HTTP 404)" in err and "Traceback" not in err
    code, err = run_main(tmp_path, f"{server.url}/nowhere/train_*.bin", capsys)
    assert code == 2 and "no shard matches" in err and "nowhere/train_*.bin" in err


def test_server_without_range_requests_exits_2(tmp_path, data, capsys):
    srv = Server(data[0].parent, NoRangeHandler)
    try:
        code, err = run_main(tmp_path, f"{srv.url}/x/train_*.bin", capsys)
    finally:
        srv.stop()
    assert code == 2 and "does not support HTTP range requests" in err and f"{srv.url}/x/train_000.bin" in err
    assert "download them" in err and "Traceback" not in err


def test_forbidden_is_an_access_error(data):
    srv = Server(data[0].parent, ForbiddenHandler)
    try:
        with pytest.raises(RemoteDataError, match=r"access to .*train_000\.bin denied \(HTTP 403\).*credentials"):
            BinShards(f"{srv.url}/x/train_000.bin")
    finally:
        srv.stop()


@pytest.mark.parametrize(
    ("url", "module"),
    [
        ("https://example.com/x/train_*.bin", "aiohttp"),
        ("s3://bucket/x/train_*.bin", "s3fs"),
        ("gs://b/x.bin", "gcsfs"),
    ],
)
def test_missing_backend_names_the_remote_extra(tmp_path, monkeypatch, capsys, url, module):
    monkeypatch.setitem(sys.modules, module, None)  # "not installed"
    with pytest.raises(MissingExtraError, match=rf"{module} package: pip install 'atma_titan\[remote\]'"):
        BinShards(url)
    code, err = run_main(tmp_path, url, capsys)
    assert code == 2 and url in err and "pip install 'atma_titan[remote]'" in err and "Traceback" not in err


# ---------------------------------------------------------------- memory://


@pytest.fixture
def memdir():
    root = f"memory://remote-shards-{uuid.uuid4().hex}"
    yield root
    fs = MemoryFileSystem()
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_training_on_memory_shards(tmp_path, memdir):
    rng = np.random.default_rng(0)
    for i in range(2):
        write_shard(f"{memdir}/train_{i:03d}.bin", rng.integers(0, 512, size=4000))
    last = train(
        load_config([*RUN, "--data.path", f"{memdir}/train_*.bin", "--job.dump_folder", str(tmp_path / "run")])
    )
    assert last["step"] == 3 and np.isfinite(last["loss"])
