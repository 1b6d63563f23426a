"""Tests for atma_titan.metrics: FLOP accounting, throughput and the logger sinks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from atma_titan import metrics
from atma_titan.metrics import (
    MetricsLogger,
    Throughput,
    device_memory_gib,
    flops_per_token,
    peak_flops,
    peak_flops_for_name,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------
# Peak FLOPs / FLOPs per token / throughput
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10G", 125e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA B200", 2.25e15),
        ("nvidia l40s", 362e12),  # case-insensitive, and "L4" must not win
    ],
)
def test_peak_flops_known_gpus(name, expected):
    assert peak_flops_for_name(name) == expected


@pytest.mark.parametrize("name", ["Tesla T4", "Tesla V100-SXM2-16GB", "NVIDIA RTX A4000", "Mystery GPU"])
def test_peak_flops_unknown_is_none(name):
    assert peak_flops_for_name(name) is None


def test_peak_flops_device(monkeypatch):
    assert peak_flops(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(torch.device("cuda", 0)) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Unknown Accelerator")
    assert peak_flops("cuda") is None


def test_flops_per_token_hand_computed():
    # 6 * 1000 + 12 * 2 layers * 4 heads * 8 head_dim * 16 tokens = 6000 + 12288
    assert flops_per_token(1000, 2, 4, 8, 16) == 18288
    # No attention layers (pure recurrent stack): only the weight term remains.
    assert flops_per_token(1000, 0, 4, 8, 16) == 6000


def test_throughput_tokens_per_second_and_mfu():
    now = [100.0]
    tp = Throughput(flops_per_token=1000, peak_flops=1e7, clock=lambda: now[0])
    tp.update(3000)
    tp.update(1000)
    now[0] += 2.0
    out = tp.compute()
    assert out["tokens_per_second"] == pytest.approx(2000.0)
    assert out["mfu"] == pytest.approx(2000.0 * 1000 / 1e7)
    # The next interval starts fresh.
    tp.update(500)
    now[0] += 1.0
    assert tp.compute()["tokens_per_second"] == pytest.approx(500.0)


def test_throughput_unknown_peak_gives_none():
    now = [0.0]
    tp = Throughput(flops_per_token=1000, peak_flops=None, clock=lambda: now[0])
    tp.update(10)
    now[0] = 1.0
    assert tp.compute() == {"tokens_per_second": 10.0, "mfu": None}


def test_device_memory_gib_cpu_is_process_rss():
    gib = device_memory_gib(torch.device("cpu"))
    # This process has imported torch: well above 10 MiB, well below 1 TiB.
    assert 0.01 < gib < 1024


# --------------------------------------------------------------------------
# MetricsLogger: stdout and jsonl
# --------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_one_line_per_log_call(tmp_path):
    with MetricsLogger(dump_folder=tmp_path, stdout=False) as logger:
        logger.log(1, {"loss": 5.0, "lr": 1e-3, "mfu": None})
        logger.log(2, {"loss": torch.tensor(4.5), "grad_norm": 0.9})
        # Flushed per call: readable before close.
        assert len(_read_jsonl(tmp_path / "metrics.jsonl")) == 2
        logger.log(3, {"loss": float("nan")})

    records = _read_jsonl(tmp_path / "metrics.jsonl")
    assert records == [
        {"step": 1, "loss": 5.0, "lr": 1e-3, "mfu": None},
        {"step": 2, "loss": 4.5, "grad_norm": 0.9},
        {"step": 3, "loss": "nan"},  # strict JSON has no NaN literal
    ]

    # A resumed run appends to the same file.
    with MetricsLogger(dump_folder=tmp_path, stdout=False) as logger:
        logger.log(4, {"loss": 4.0})
    assert [r["step"] for r in _read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_stdout_line_format(tmp_path, capsys):
    with MetricsLogger(dump_folder=tmp_path, jsonl=False) as logger:
        logger.log(
            10,
            {
                "loss": 5.12341,
                "grad_norm": 1.0234,
                "lr": 2e-2,
                "tokens_per_second": 12345.4,
                "mfu": 0.3512,
                "memory_gib": 3.21,
            },
        )
        logger.log(11, {"loss": 5.0, "mfu": None})
        logger.log(12, {"loss": 4.9, "val_loss": 4.25})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "step   10 | loss 5.1234 | grad_norm 1.02 | lr 2.0e-02 | tok/s 12,345 | mfu 35.1% | mem 3.2 GiB"
    )
    assert "loss 5.0000" in lines[1] and "mfu unknown peak" in lines[1]
    assert "mfu unknown peak" in lines[2] and "val_loss 4.25" in lines[2]
    # No jsonl requested and nothing else enabled: no folder contents.
    assert not (tmp_path / "metrics.jsonl").exists()


def test_non_zero_rank_writes_nothing(tmp_path, capsys):
    dump = tmp_path / "run"
    # TensorBoard and wandb are enabled too: rank 1 must not even import them.
    with MetricsLogger(dump_folder=dump, rank=1, tensorboard=True, wandb=True) as logger:
        logger.log(1, {"loss": 1.0, "mfu": None})
    assert not dump.exists()
    assert capsys.readouterr().out == ""


def test_invalid_wandb_mode_rejected(tmp_path):
    with pytest.raises(ValueError, match="wandb_mode"):
        MetricsLogger(dump_folder=tmp_path, wandb_mode="sometimes")


@pytest.mark.parametrize(
    "module, kwargs, hint",
    [
        ("torch.utils.tensorboard", {"tensorboard": True}, "pip install tensorboard"),
        ("wandb", {"wandb": True, "wandb_mode": "offline"}, "pip install wandb"),
    ],
)
def test_missing_optional_package_has_clear_error(tmp_path, monkeypatch, module, kwargs, hint):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    key = "metrics." + next(iter(kwargs))
    with pytest.raises(ImportError) as err:
        MetricsLogger(dump_folder=tmp_path, stdout=False, jsonl=False, **kwargs)
    assert hint in str(err.value) and key in str(err.value)


# --------------------------------------------------------------------------
# MetricsLogger: TensorBoard and wandb (on disk)
# --------------------------------------------------------------------------


def test_tensorboard_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(
        dump_folder=tmp_path, stdout=False, jsonl=False, tensorboard=True, config={"lr": 0.02}
    ) as logger:
        logger.log(1, {"loss": 5.0, "mfu": None})
        logger.log(2, {"loss": 4.0, "mfu": 0.3})

    event_files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 5.0), (2, 4.0)]
    # A None mfu is skipped, not logged as 0.
    assert [e.step for e in acc.Scalars("mfu")] == [2]


# Runs in a subprocess so wandb's global state, atexit hooks and stdout
# wrapping stay out of the pytest process, and so that network use at *exit*
# (where wandb's telemetry flushes) is observed too.
_WANDB_SCRIPT = textwrap.dedent(
    """
    import socket, sys

    # Refuse (and report) any non-local network use: offline must stay offline.
    def _refuse(what):
        sys.stderr.write(f"NETWORK ATTEMPT: {what}\\n")
        raise OSError("network disabled in test")

    _connect = socket.socket.connect
    def _guarded_connect(self, address):
        if self.family != socket.AF_UNIX:
            _refuse(address)
        return _connect(self, address)
    socket.socket.connect = _guarded_connect
    socket.getaddrinfo = lambda host, *a, **k: _refuse(host)

    from atma_titan.metrics import MetricsLogger

    with MetricsLogger(dump_folder=sys.argv[1], stdout=False, wandb=True,
                       wandb_mode="offline", wandb_run_name="unit-test",
                       config={"model": "tiny", "lr": 0.02}) as logger:
        logger.log(1, {"loss": 5.0, "mfu": None})
        logger.log(2, {"loss": 4.0, "mfu": 0.3})
    print("WANDB_DONE")
    """
)


def test_wandb_offline_writes_run_dir_without_network(tmp_path):
    pytest.importorskip("wandb")
    dump = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        WANDB_SILENT="true",
        # Keep wandb's per-user state inside the test's tmp dir.
        WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb_data"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _WANDB_SCRIPT, str(dump)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "WANDB_DONE" in proc.stdout
    assert "NETWORK ATTEMPT" not in proc.stderr, proc.stderr

    run_dirs = list((dump / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, list((dump / "wandb").iterdir())
    assert list(run_dirs[0].glob("run-*.wandb")), "offline run has no .wandb data file"
    # The jsonl sink ran alongside wandb.
    assert len((dump / "metrics.jsonl").read_text().splitlines()) == 2


def test_public_api_exports():
    for name in metrics.__all__:
        assert hasattr(metrics, name)
