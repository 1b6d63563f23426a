"""Run the trainer in subprocesses: one process, or torchrun with several (gloo on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# A small, fast, fully deterministic fp32 job; each test adds its own overrides.
TINY = [
    "--config",
    "train_configs/debug_model.toml",
    "--training.seq_len",
    "32",
    "--training.batch_tokens",
    "256",
    "--training.micro_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--job.print_config",
    "false",
    "--job.deterministic",
    "true",
    "--training.device",
    "cpu",
]

ROOT = Path(__file__).resolve().parents[2]


def run_trainer(nproc: int, *args: str, timeout: int = 300, torchrun: bool = False) -> subprocess.CompletedProcess:
    """One process is plain python (no FSDP) unless `torchrun`; several are always torchrun (FSDP2)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if nproc == 1 and not torchrun:
        cmd = [sys.executable, "-m", "atma_titan.train", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "atma_titan.train",
            *args,
        ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def losses(folder: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}  # a resumed run appends; later rows win


# Appended to every run_gloo_script script: rank 0 writes the script's `result`, then every rank leaves.
GLOO_SCRIPT_END = """
import json as _json, os as _os, sys as _sys
import torch.distributed as _dist
if _dist.get_rank() == 0:
    with open(_sys.argv[1], "w") as f:
        _json.dump(result, f)
_dist.barrier()
_dist.destroy_process_group()
_os._exit(0)  # see tests/parallel/test_distributed.py: gloo's C++ teardown at exit is flaky on CPU
"""


def run_gloo_script(script: str, world: int, folder: Path, timeout: int = 240) -> dict:
    """Run `script` (Python source that starts the gloo group and sets `result`, a JSON-able dict) on `world`
    ranks under torchrun, and return rank 0's `result`."""
    path, out = Path(folder) / "script.py", Path(folder) / "result.json"
    path.write_text(script + GLOO_SCRIPT_END)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, str(out)], timeout=timeout, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())
