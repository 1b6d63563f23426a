"""Shared by the whole suite.

It runs on every core through pytest-xdist (pyproject's addopts: `-n auto`). Each worker,
and every trainer or torchrun rank it starts, then uses one thread: the workers already fill the
cores, and OpenMP threads that compete with another worker's processes run far slower than one
thread each (the debug model's 2-thread training took 6x longer beside a second worker).
`python -m pytest -n 0` runs in one process with torch's default threads.

The folders mirror the package; the code the tests share lives in tests/support/, importable by its
module name from any of them."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the subprocesses the tests start

    import torch

    torch.set_num_threads(1)


@pytest.fixture
def one_rank_gloo():
    """A one-rank gloo process group in this process, for code that needs one (DTensor meshes, FSDP2)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
