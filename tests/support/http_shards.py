"""Loopback HTTP servers for the remote-shard tests (tests/data/test_remote_shards.py, tests/utils/test_redaction.py).

Python's http.server serves files and HTML index pages (which fsspec's HTTP glob parses for links)
but ignores Range headers: `RangeHandler` adds single-range GETs; `NoRangeHandler` is the plain one,
a server without range support. `Server` runs one in a thread and can be stopped and started again
on the same port, as a restarted server would be.
"""

from __future__ import annotations

import http.server
import io
import os
import re
import threading
from functools import partial

import numpy as np

from atma_titan.data.shards import write_shard


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class NoRangeHandler(QuietHandler):
    """A server without range requests: every GET answers 200 with the whole file."""


class RangeHandler(QuietHandler):
    """Files with single-range GETs (206 + Content-Range), folders as HTML index pages."""

    on_request = None  # test hook: called with (handler, range start or None) before each answer

    def send_head(self):
        spec = self.headers.get("Range")
        hook = type(self).on_request
        if hook is not None and hook(self, int(spec.split("=")[1].split("-")[0]) if spec else None) == "drop":
            self.close_connection = True  # a killed server: no answer at all
            return None
        path = self.translate_path(self.path)
        if spec is None or os.path.isdir(path):
            return super().send_head()
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        size = os.path.getsize(path)
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", spec)
        start, end = int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)
        if start >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.end_headers()
            return None
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        return io.BytesIO(data)


class ForbiddenHandler(QuietHandler):
    def send_head(self):
        self.send_error(403)
        return None


class Server:
    """`handler` serving folder `root` on 127.0.0.1 in a daemon thread; `url` is its base URL."""

    def __init__(self, root, handler=RangeHandler, port: int = 0) -> None:
        self.root, self.handler = str(root), handler
        self._httpd = None
        self.port = port
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", self.port), partial(self.handler, directory=self.root)
        )
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


def make_shards(folder, sizes, *, seed=0, high=512):
    """train_000.bin, ... of the given sizes (ids < high: the debug model's vocabulary is 512); returns the tokens."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, high, size=n) for n in sizes]
    for i, part in enumerate(parts):
        write_shard(str(folder / f"train_{i:03d}.bin"), part)
    return np.concatenate(parts)
