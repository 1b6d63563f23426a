"""The synthetic-language needle (eval --records) and the in-training evaluation."""

import json
import math
import subprocess
import sys

import pytest
from helpers import EVAL_TRAIN as TRAIN
from helpers import Induction

from atma_titan.config import load_config
from atma_titan.data.synthetic import SyntheticSource
from atma_titan.eval.records import evaluate_records
from atma_titan.train import train


class ShortInduction(Induction):
    """Induction on the last 3 tokens: exactly what recalling `MARK key -> value` needs."""

    span = 3


def test_perfect_recall_scores_one_and_the_control_has_nothing_to_recall():
    source = SyntheticSource(64, seed=1)
    r = evaluate_records(ShortInduction(64), source, gap=50, trials=5)
    assert r.variant == "records" and r.digit_acc == 1.0 and r.exact_acc == 1.0 and r.ce < 1e-6
    # The control's query has no earlier occurrence: no guess for the first value token.
    assert r.control_ce > 0.4 * math.log(64)


def test_in_training_eval_logs_validation_loss_and_recall(tmp_path):
    train(
        load_config(
            [
                "--training.steps",
                "2",
                "--training.seq_len",
                "32",
                "--training.batch_tokens",
                "256",
                "--training.micro_batch_size",
                "8",
                "--metrics.stdout",
                "false",
                "--job.print_config",
                "false",
                "--eval.interval",
                "2",
                "--eval.needle_gaps",
                "16,64",
                "--eval.needle_trials",
                "3",
                "--job.dump_folder",
                str(tmp_path),
            ]
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "val_loss" not in rows[0] and 0 < rows[-1]["val_loss"] < 7
    assert {"recall@16", "recall@64"} <= rows[-1].keys()


def test_eval_records_command_and_its_guard(tmp_path):
    train(load_config(TRAIN + ["--job.dump_folder", str(tmp_path / "run")]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "atma_titan.eval",
            "--checkpoint",
            str(tmp_path / "run"),
            "--records",
            "--gaps",
            "16,64",
            "--trials",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())["needle"]
    assert [(r["variant"], r["gap"]) for r in rows] == [("records", 16), ("records", 64)]
    assert all(r["control_ce"] is not None for r in rows)


@pytest.mark.parametrize("name", ["polar_memory", "polar_nomemory", "softmax_memory", "softmax_nomemory"])
def test_repro_configs_build_and_train_a_step(tmp_path, name):
    cfg = load_config(
        [
            "--config",
            f"train_configs/repro/{name}.toml",
            "--training.steps",
            "1",
            "--training.batch_tokens",
            "256",
            "--training.micro_batch_size",
            "2",
            "--eval.interval",
            "1",
            "--eval.needle_gaps",
            "64",
            "--eval.needle_trials",
            "2",
            "--eval.val_batches",
            "1",
            "--metrics.stdout",
            "false",
            "--job.print_config",
            "false",
            "--checkpoint.enable",
            "false",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    last = train(cfg)
    assert last["step"] == 1 and "recall@64" in last
