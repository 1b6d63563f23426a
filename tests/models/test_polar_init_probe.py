"""benchmarks/train/polar_init.py: the Polar init probe runs on CPU, its arms' commands, and its summary table.

The probe's full runs need a GPU (benchmarks/results/polar_init-h200-2026-12-01/); here a few CPU steps check
the report's shape and the init measurement behind the fix (a unit c reaches W_o ~8x below the memory
readout), and the summary is checked on hand-written reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "train"))

import polar_init  # noqa: E402


@pytest.mark.slow
def test_probe_runs_on_cpu_and_writes_its_report(tmp_path):
    out = tmp_path / "arm.json"
    argv = ["--config", "train_configs/repro/polar_memory.toml", "--json", str(out), "--device", "cpu"]
    argv += ["--steps", "2", "--batch", "1", "--probe-batch", "1", "--every", "1", "--set", "len_gain=-6"]
    assert polar_init.main([*argv, "--", "--model.polar_direction", "unit"]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == {"attention": "polar", "memory": True, "polar_direction": "unit"}
    assert report["polar_inits"] == {"len_gain": -6.0}
    init = report["init"]
    assert set(init["attention"]["real_mass_by_n"]) == {"1", "8", "32", "64", "128"}
    assert 0 < init["attention"]["top_weight_among_real"] <= 1
    assert set(init["grad_norm_with_probe_w_o"]) == {"q_proj", "k_proj", "v_proj"}
    ratio = init["scale"]["memory_readout_rms"] / init["scale"]["w_o_input_rms"]
    assert 6 < ratio < 10, f"a unit c should reach W_o ~sqrt(64) = 8x below the memory readout, got {ratio:.2f}x"
    assert [row["step"] for row in report["train"]] == [1, 2]
    row = report["train"][-1]
    assert {"loss", "grad_norm", "recall_acc", "recall_ce", "attention", "scale"} <= set(row)
    assert 0 <= row["recall_acc"] <= 1


def test_bad_polar_init_name_is_an_input_error(tmp_path, capsys):
    argv = ["--config", "train_configs/repro/polar_nomemory.toml", "--json", str(tmp_path / "x.json")]
    assert polar_init.main([*argv, "--device", "cpu", "--set", "len_gian=-6"]) == 2
    assert "len_gian" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_each_arm_runs_its_config_inits_and_overrides_with_the_shared_flags(tmp_path):
    opts = polar_init.parse_args(["--arms", "all", "--out", str(tmp_path), "--steps", "7", "--device", "cpu"])
    cmd = polar_init.arm_command("polar_nomemory-unit-len_gain-6", opts, tmp_path)
    child = polar_init.parse_args(cmd[2:])  # past the interpreter and the script
    assert child.config == "train_configs/repro/polar_nomemory.toml"
    assert child.set == "len_gain=-6" and child.overrides == ["--model.polar_direction", "unit"]
    assert child.json == tmp_path / "polar_nomemory-unit-len_gain-6.json"
    assert (child.steps, child.device, child.batch) == (7, "cpu", 64)


def report(rows):
    return {"train": [{"step": s, "recall_acc": acc, "loss": loss} for s, acc, loss in rows]}


def test_summary_table_rows_come_from_the_reports(tmp_path):
    (tmp_path / "softmax_nomemory.json").write_text(json.dumps(report([(100, 0.005, 35.75), (300, 0.0, 32.06)])))
    (tmp_path / "polar_nomemory-rms.json").write_text(json.dumps(report([(100, 0.005, 35.79), (300, 0.136, 25.54)])))
    (tmp_path / "summary.md").write_text(f"# notes kept\n\n{polar_init.SUMMARY_MARK}\nold table\n")
    table = polar_init.write_summary(tmp_path, steps=(100, 300, 600))
    assert table.splitlines() == [
        "| arm | step 100 | step 300 | step 600 |",
        "| --- | --- | --- | --- |",
        "| polar_nomemory-rms | 0.5 (35.79) | 13.6 (25.54) | - |",  # ARMS order, not the file names'
        "| softmax_nomemory | 0.5 (35.75) | 0.0 (32.06) | - |",
    ]
    text = (tmp_path / "summary.md").read_text()
    assert text.startswith("# notes kept\n") and "old table" not in text and text.endswith(table)


def test_summary_keeps_notes_written_without_the_marker(tmp_path):
    (tmp_path / "softmax_nomemory.json").write_text(json.dumps(report([(100, 1.0, 2.5)])))
    (tmp_path / "summary.md").write_text("# What was run\n\nnotes\n")
    table = polar_init.write_summary(tmp_path, steps=(100,))
    assert (tmp_path / "summary.md").read_text() == (
        f"# What was run\n\nnotes\n\n{polar_init.SUMMARY_MARK}\n\n"
        "Recall-token accuracy % on the fixed probe batch (the training batch's weighted loss):\n\n" + table
    )
    assert "| softmax_nomemory | 100.0 (2.50) |" in table
    polar_init.write_summary(tmp_path, steps=(100,))  # again: the same file, not a second table
    assert (tmp_path / "summary.md").read_text().count("| arm |") == 1
