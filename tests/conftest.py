"""The suite runs on every core through pytest-xdist (pyproject's addopts: `-n auto`). Each worker,
and every trainer or torchrun rank it starts, then uses one thread: the workers already fill the
cores, and OpenMP threads that compete with another worker's processes run far slower than one
thread each (the debug model's 2-thread training took 6x longer beside a second worker).
`python -m pytest -n 0` runs in one process with torch's default threads."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the subprocesses the tests start

    import torch

    torch.set_num_threads(1)
