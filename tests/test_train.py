import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atma_titan.config import load_config
from atma_titan.train import train

SMALL = [
    "--training.steps",
    "3",
    "--training.seq_len",
    "32",
    "--training.batch_tokens",
    "256",
    "--training.micro_batch_size",
    "4",
    "--metrics.log_freq",
    "1",
    "--job.print_config",
    "false",
]


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
    from atma_titan.train import initial_state_dict

    assert exported.keys() == initial_state_dict(load_config(SMALL)).keys()  # clean names, no wrapper prefixes
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
