"""The synthetic-language needle (eval --records) and the in-training evaluation."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from helpers import EVAL_TRAIN as TRAIN
from helpers import Induction

from atma_titan.config import load_config
from atma_titan.data.synthetic import SyntheticSource
from atma_titan.eval.common import EvalInputError
from atma_titan.eval.records import PROBE_INDEX, evaluate_records, records_probe, run_records
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


@pytest.mark.parametrize("gap", [16, 50, 101, 256])
@pytest.mark.parametrize("depth", [0.0, 0.5, 0.9])
def test_depth_places_the_record_that_fraction_into_the_gap_filler(depth, gap):
    source = SyntheticSource(64, seed=3)
    n, index = source.record_len, PROBE_INDEX + 5
    base, positions = source.recall_probe(index, gap)  # the depth-0 layout: EOT, record, filler, record
    record, filler = base[1 : 1 + n], base[1 + n : 1 + n + gap]
    probe = records_probe(source, index, gap, depth)
    k = round(depth * gap)
    tokens = probe.tokens
    assert len(tokens) == 1 + gap + 2 * n and tokens[0] == source.eot_id
    assert probe.needle_at == 1 + k and np.array_equal(tokens[1 : 1 + k], filler[:k])  # k filler tokens before
    assert np.array_equal(tokens[1 + k : 1 + k + n], record) and tokens[1 + k] == source.mark_id
    assert np.array_equal(tokens[1 + k + n : 1 + n + gap], filler[k:])  # gap - k between the needle and the query
    assert np.array_equal(tokens[-n:], record) and (tokens == source.mark_id).sum() == 2
    assert np.array_equal(probe.value_positions, positions) and list(positions) == list(
        range(len(tokens) - 2, len(tokens))
    )
    if depth == 0:
        assert np.array_equal(tokens, base)  # depth 0 is the source's own probe
    # The control: the same filler around a stand-in at the same place, the same query; nothing to recall.
    control = records_probe(source, index, gap, depth, with_needle=False)
    outside = np.r_[0 : 1 + k, 1 + k + n : len(tokens)]
    assert len(control.tokens) == len(tokens) and np.array_equal(control.tokens[outside], tokens[outside])
    assert (control.tokens == source.mark_id).sum() == 1


def test_bad_depth_is_bad_input():
    with pytest.raises(EvalInputError, match=r"depth must be in \[0, 1\), got 1.0"):
        records_probe(SyntheticSource(64), 0, 10, 1.0)


def test_run_records_writes_one_row_per_depth_and_gap():
    source = SyntheticSource(64, seed=1)
    lines = []
    rows = run_records(ShortInduction(64), source, gaps=[20, 40], depths=[0, 0.5, 0.9], trials=3, progress=lines.append)
    assert [(r.depth, r.gap) for r in rows] == [(d, g) for d in (0.0, 0.5, 0.9) for g in (20, 40)]
    assert all(r.digit_acc == 1.0 and r.exact_acc == 1.0 and r.control_ce > 1.0 for r in rows)  # found at every depth
    assert len(lines) == 6 and "depth 0.90" in lines[-1] and "exact 100.0%" in lines[-1]


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
            "--depths",
            "0,0.5",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "synthetic records, 2 depth(s) x gaps 16, 64" in proc.stdout
    out = tmp_path / "run" / "eval"
    rows = json.loads((out / "results.json").read_text())["needle"]
    assert [(r["variant"], r["depth"], r["gap"]) for r in rows] == [
        ("records", d, g) for d in (0.0, 0.5) for g in (16, 64)
    ]
    assert all(r["control_ce"] is not None for r in rows)
    md = (out / "results.md").read_text()
    assert "| variant | depth | 16 (0.5x) | 64 (2x) |" in md  # trained at seq_len 32
    for table in ("exact recall (% of trials) by gap", "per-token accuracy (% of value tokens) by gap"):
        body = md[md.index(table) :].split("\n\n")[1].splitlines()[2:]
        assert [line.split("|")[1:3] for line in body] == [[" records ", " before haystack "], [" records ", " 50% "]]
    assert (out / "needle.png").stat().st_size > 0


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
