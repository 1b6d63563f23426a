import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SMALL

from atma_titan.config import load_config
from atma_titan.train import train


def read_metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def run_train(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atma_titan.train", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


@pytest.mark.slow
def test_debug_config_trains_and_loss_falls(tmp_path):
    proc = run_train("--config", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "step  100 | loss" in proc.stdout  # progress on stdout
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1] + list(range(10, 101, 10))
    for key in ("loss", "lr", "grad_norm", "tokens_per_second", "mfu"):
        assert key in rows[0]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    # The README shows this run's first and last loss: any change to what the default model computes (a kernel's
    # rounding included, e.g. a new code path with its switch off) shows here.
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for step in (1, 100):
        shown = re.search(rf"^step +{step} \| loss ([0-9.]+)", readme, re.M).group(1)
        assert f"{rows[0 if step == 1 else -1]['loss']:.4f}" == shown, f"step {step}: README shows loss {shown}"
    assert (tmp_path / "config.toml").read_text() == load_config(
        ["--config", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path)]
    ).to_toml()


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    one = train(load_config(SMALL + ["--job.dump_folder", str(tmp_path / "a"), "--metrics.stdout", "false"]))
    acc = train(
        load_config(
            SMALL
            + [
                "--job.dump_folder",
                str(tmp_path / "b"),
                "--metrics.stdout",
                "false",
                "--training.micro_batch_size",
                "2",
            ]
        )
    )
    assert one["loss"] == pytest.approx(acc["loss"], rel=1e-4)


def test_wandb_offline_and_tensorboard_write_logs(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    proc = run_train(
        *SMALL,
        "--job.dump_folder",
        str(tmp_path),
        "--metrics.tensorboard",
        "true",
        "--metrics.wandb",
        "true",
        "--metrics.wandb_mode",
        "offline",
        env={
            "WANDB_SILENT": "true",
            "WANDB_DIR": str(tmp_path),
            "WANDB_CONFIG_DIR": str(tmp_path),
            "WANDB_CACHE_DIR": str(tmp_path),
        },
    )
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_fine_tune_from_weights_and_export_safetensors(tmp_path):
    import torch
    from safetensors.torch import load_file

    base = [*SMALL, "--metrics.stdout", "false", "--checkpoint.enable", "true"]
    train(load_config(base + ["--job.dump_folder", str(tmp_path / "pre"), "--checkpoint.export_safetensors", "true"]))
    exported = load_file(tmp_path / "pre" / "model.safetensors")
    from atma_titan.models import initial_weights, resolve_model_args

    cfg = load_config(SMALL)
    assert exported.keys() == initial_weights(resolve_model_args(cfg.model), cfg.job.seed).keys()  # clean names
    assert exported["head.weight"].shape == (512, 128)
    saved = tmp_path / "pre" / "checkpoints" / "step-3"
    # Fine-tuning: weights from another run's checkpoint, fresh optimizer and step counter.
    tuned = train(
        load_config(
            base
            + [
                "--job.dump_folder",
                str(tmp_path / "tune"),
                "--checkpoint.load_path",
                str(saved),
                "--checkpoint.model_only",
                "true",
                "--training.steps",
                "1",
            ]
        )
    )
    assert tuned["step"] == 1
    first_pre = [r for r in read_metrics(tmp_path / "pre") if r["step"] == 1][0]["loss"]
    assert tuned["loss"] < first_pre  # it started from the trained weights, not from scratch
    assert torch.isfinite(exported["embed.weight"]).all()


def test_recall_weight_scales_the_recall_labels_of_the_loss(tmp_path):
    """Same model, same first batch: the weighted first-step loss is the plain one plus (w - 1) x the recall part."""
    from atma_titan.train import cross_entropy_sum

    logits = torch.randn(2, 6, 11)
    labels = torch.randint(0, 11, (2, 6))
    weights = torch.ones(2, 6)
    weights[0, 2] = weights[1, 5] = 4.0
    per_label = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 6)
    expected = per_label.sum() + 3.0 * (per_label[0, 2] + per_label[1, 5])
    torch.testing.assert_close(cross_entropy_sum(logits, labels, weights), expected)

    plain = tmp_path / "plain"
    weighted = tmp_path / "weighted"
    for folder, extra in ((plain, []), (weighted, ["--data.recall_weight", "25"])):
        cfg = load_config(["--config", "train_configs/debug_model.toml", *SMALL, "--training.steps", "1", *extra])
        cfg.job.dump_folder = str(folder)
        train(cfg)
    assert read_metrics(weighted)[0]["loss"] > read_metrics(plain)[0]["loss"]  # recall tokens now count 25 times


# ---- the run's story, its folder and its metrics (a new user's first hour) ------------------------


def small_run(folder: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_train("--config", "train_configs/debug_model.toml", *SMALL, "--job.dump_folder", str(folder), *extra)


def test_stdout_tells_the_run_header_checkpoints_and_summary(tmp_path):
    proc = small_run(tmp_path, "--checkpoint.interval", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("atma_titan: debug model, ") and " parameters (4 blocks, 1 global, polar attention" in out
    assert "batch 8 x 32 = 256 tokens a step (2 micro-batches of 4 on each of 1 rank); 3 steps = 768 tokens" in out
    assert f"run folder {tmp_path}: config.toml, metrics.jsonl; checkpoints every 2 steps" in out
    assert "[job]" not in out  # the resolved config goes to config.toml, not to stdout
    for step in (2, 3):
        assert re.search(
            rf"checkpoint step {step} saved: {tmp_path}/checkpoints/step-{step} \([0-9.]+ [KM]B, [0-9.]+ s\)", out
        )
    assert re.search(r"step    2 \| loss .* \| eta \d+s", out)  # the time left, from the second step on
    assert "done: step 3 of 3, 768 tokens seen; this run trained 3 steps in " in out
    assert re.search(r"final train loss \d\.\d{4}", out)
    assert f"run folder {tmp_path}: config.toml, metrics.jsonl, checkpoints/step-3, DONE" in out


def test_resume_logs_its_first_step_and_never_duplicates_metrics_rows(tmp_path):
    common = ["--training.steps", "6", "--metrics.log_freq", "4", "--checkpoint.interval", "2"]
    stopped = small_run(tmp_path, *common, "--debug.signal_at_step", "3")
    assert stopped.returncode == 0, stopped.stderr
    assert (
        "stopped at step 3 on request (SIGTERM): checkpoint step 3 saved; run the same command to resume"
        in stopped.stdout
    )
    # A crash after step 4's row (the checkpoint stays at 3): the rows past 3 must not stay.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "loss": 9.0}) + "\n")
    resumed = small_run(tmp_path, *common)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {tmp_path}/checkpoints/step-3 at step 3" in resumed.stdout
    assert "step    4 | loss" in resumed.stdout  # the first step after a resume is always logged
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 3, 4, 6]
    assert {"event": "resume", "step": 3} in rows
    assert rows.index({"event": "resume", "step": 3}) == 2


def test_a_finished_run_rerun_is_already_complete(tmp_path):
    assert small_run(tmp_path).returncode == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    again = small_run(tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"{tmp_path} is already complete at step 3: nothing to do"
    assert (tmp_path / "metrics.jsonl").read_text() == before and (tmp_path / "DONE").read_text() == "3\n"


def test_a_new_run_in_another_runs_folder_is_refused(tmp_path):
    assert small_run(tmp_path, "--checkpoint.enable", "false").returncode == 0
    other = small_run(tmp_path, "--checkpoint.enable", "false", "--model.attention", "softmax")
    assert other.returncode == 2
    assert other.stderr.startswith(f"error: job.dump_folder {tmp_path} holds another run (metrics.jsonl has steps 1..3")
    assert "choose another job.dump_folder" in other.stderr and "Traceback" not in other.stderr
    # The same run again (no checkpoint to resume) after an unfinished attempt starts over, rows dropped.
    (tmp_path / "DONE").unlink()
    again = small_run(tmp_path, "--checkpoint.enable", "false")
    assert again.returncode == 0, again.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"event": "resume", "step": 0} and [r["step"] for r in rows[1:]] == [1, 2, 3]


def test_an_export_failure_keeps_done_and_a_rerun_retries_the_export(tmp_path):
    (tmp_path / "model.safetensors").mkdir(parents=True)  # the export cannot replace a directory
    (tmp_path / "model.safetensors" / "x").write_text("")
    failed = small_run(tmp_path, "--checkpoint.export_safetensors", "true")
    assert failed.returncode == 1
    assert failed.stderr.startswith("error: training is complete (DONE at step 3) but writing ")
    assert "re-run the same command to retry the export" in failed.stderr
    assert (tmp_path / "DONE").read_text() == "3\n"  # the finished run stays finished
    shutil.rmtree(tmp_path / "model.safetensors")
    retried = small_run(tmp_path, "--checkpoint.export_safetensors", "true")
    assert retried.returncode == 0, retried.stderr
    assert "nothing left to train" in retried.stdout and f"exported {tmp_path}/model.safetensors" in retried.stdout
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "DONE").read_text() == "3\n"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]  # nothing was trained twice


def test_wandb_online_without_credentials_is_a_one_line_error_before_training(tmp_path):
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home), WANDB_DIR=str(tmp_path), NETRC=str(home / "netrc"))
    proc = subprocess.run(
        [sys.executable, "-m", "atma_titan.train", "--config", "train_configs/debug_model.toml", *SMALL,
         "--job.dump_folder", str(tmp_path / "run"), "--metrics.wandb", "true"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "wandb login" in errors[0] and "metrics.wandb_mode = 'offline'" in errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was trained
    assert "step    1" not in proc.stdout
