"""Resuming through the real command: a changed run is refused before anything is written, an allowed
change is said, and a continued run follows the schedule of its new length from its first new step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SMALL

from atma_titan.config import load_config
from atma_titan.optim import lr_factor

CONFIG = "train_configs/debug_model.toml"


def run_train(folder: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "atma_titan.train", "--config", CONFIG, *SMALL, "--job.dump_folder", str(folder)]
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=dict(os.environ), timeout=600)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def logged_lr(folder: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["lr"] for row in rows if "lr" in row}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("run")
    proc = run_train(folder)
    assert proc.returncode == 0, proc.stderr
    return folder


@pytest.mark.parametrize(
    "change, saved, requested",
    [
        (("--model.attention", "softmax"), "'polar'", "'softmax'"),
        (("--model.d_model", "64"), "128", "64"),
        (("--model.memory", "false"), "True", "False"),
        (("--training.seq_len", "64"), "32", "64"),
        (("--data.seed", "7"), "1234", "7"),
        (("--optimizer.muon_lr", "0.5"), None, "0.5"),
    ],
)
def test_a_resume_that_changes_the_run_is_refused_and_the_folder_stays_byte_for_byte(
    finished_run, change, saved, requested
):
    before = snapshot(finished_run)
    proc = run_train(finished_run, "--training.steps", "5", *change)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    key = change[0][2:]
    message = proc.stderr.strip()
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith(f"error: cannot resume {finished_run}: ")
    assert f"{key} saved " in message and (saved is None or f"{key} saved {saved}, requested {requested}" in message)
    assert "choose another job.dump_folder" in message and "docs/training.md" in message
    assert snapshot(finished_run) == before  # config.toml, metrics.jsonl, checkpoints and DONE untouched


def test_a_model_key_set_to_its_flavors_value_is_no_change(finished_run, tmp_path):
    d_model = str(load_config(["--config", CONFIG]).model.d_model or 128)
    proc = run_train(finished_run, "--model.d_model", d_model)
    assert proc.returncode == 0, proc.stderr
    assert "already complete at step 3" in proc.stdout


def test_a_continued_run_says_what_changed_and_follows_the_new_length_from_its_first_step(tmp_path):
    short, straight = tmp_path / "short", tmp_path / "straight"
    assert run_train(short, "--training.steps", "4").returncode == 0
    continued = run_train(short, "--training.steps", "8", "--metrics.log_freq", "2")
    assert continued.returncode == 0, continued.stderr
    assert f"resumed from {short}/checkpoints/step-4 at step 4" in continued.stdout
    assert "changed since the run's config.toml: metrics.log_freq saved 1, requested 2; training.steps saved 4, " \
        "requested 8" in continued.stdout
    assert run_train(straight, "--training.steps", "8").returncode == 0

    cfg = load_config(["--config", CONFIG, *SMALL, "--training.steps", "8"])
    factor = lr_factor(cfg.lr_scheduler, 8)
    resumed, reference = logged_lr(short), logged_lr(straight)
    # The first new step trains at the schedule's value for step 5 of 8 (it trained at lr 0 when the
    # saved optimizer's last lr was used before the schedule recomputed it), and so does every later one.
    assert resumed[5] > 0
    for step in (5, 6, 8):  # logged: the first step after a resume, then every log_freq
        assert resumed[step] == pytest.approx(reference[step], rel=1e-12)
        assert resumed[step] / reference[5] == pytest.approx(factor(step - 1) / factor(4), rel=1e-12)


def test_a_saved_config_the_trainer_cannot_read_is_one_line_naming_it(finished_run, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(finished_run, folder)
    saved = folder / "config.toml"
    saved.write_text(saved.read_text().replace("[model]\n", "[model]\nretired_key = 1\n"))
    proc = run_train(folder, "--training.steps", "5")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{saved}" in proc.stderr and "retired_key" in proc.stderr
