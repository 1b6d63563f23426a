"""eval --steps (the needle at every checkpoint of a run), --generate-gaps (both readings in one results.json)
and --no-control, on the debug run of conftest.run_dir (checkpoints at steps 1 and 2, synthetic data)."""

from __future__ import annotations

import json

import pytest

from atma_titan.eval.__main__ import main as eval_main

NEEDLE = ["--records", "--gaps", "16,64", "--trials", "3", "--depths", "0,0.5"]


def results(out) -> dict:
    return json.loads((out / "results.json").read_text())


def test_steps_evaluate_every_checkpoint_with_both_readings(run_dir, tmp_path):
    out = tmp_path / "steps"
    argv = ["--checkpoint", str(run_dir), "--steps", "all", "--no-control", "--generate-gaps", "64", "--out", str(out)]
    assert eval_main(argv + NEEDLE) == 0
    got = results(out)
    assert [s["step"] for s in got["over_training"]] == [1, 2] and got["step"] == 2
    assert got["over_training"][-1]["needle"] == got["needle"]  # the top level is the last step's
    for step in got["over_training"]:
        rows = [(r.get("mode"), r["depth"], r["gap"]) for r in step["needle"]]
        teacher = [("teacher_forced", d, g) for d in (0.0, 0.5) for g in (16, 64)]
        assert rows == teacher + [("generated", d, 64) for d in (0.0, 0.5)]
        assert all(r["control_ce"] is None for r in step["needle"])  # --no-control
    # Step 1's rows are step 1's model: the same numbers as evaluating that checkpoint alone.
    alone = tmp_path / "step1"
    assert eval_main(["--checkpoint", str(run_dir), "--step", "1", "--out", str(alone), *NEEDLE]) == 0
    first = {(r["depth"], r["gap"]): r["ce"] for r in results(alone)["needle"]}
    over = {(r["depth"], r["gap"]): r["ce"] for r in got["over_training"][0]["needle"] if r["mode"] != "generated"}
    last = {(r["depth"], r["gap"]): r["ce"] for r in got["needle"] if r["mode"] != "generated"}
    assert over == pytest.approx(first, rel=1e-5) and last != pytest.approx(first, rel=1e-5)
    assert all(r["control_ce"] is not None for r in results(alone)["needle"])  # the control by default
    md = (out / "results.md").read_text()
    table = md[md.index("## Exact recall (%) over training") :].splitlines()
    assert table[2].startswith("| step | 16 (0.5x) before haystack |") and "64 (2x) 50% generated" in table[2]
    assert [line.split("|")[1].strip() for line in table[4:6]] == ["1", "2"]


def test_a_list_of_steps_is_those_steps(run_dir, tmp_path):
    folder = str(run_dir / "checkpoints")
    assert eval_main(["--checkpoint", folder, "--steps", "1", "--out", str(tmp_path), *NEEDLE]) == 0
    got = results(tmp_path)
    assert [s["step"] for s in got["over_training"]] == [1] and got["step"] == 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--steps", "1,3"], "no complete checkpoint for step(s) 3"),
        (["--steps", "all", "--step", "1"], "--step is one checkpoint and --steps several"),
        (["--steps", "two"], "expected checkpoint steps like 150,300,450"),
        (["--steps", "all", "--no-needle", "--length-curve"], "--steps evaluates the needle over training"),
        (["--generate", "--generate-gaps", "64"], "--generate-gaps adds generated rows"),
    ],
)
def test_bad_steps_and_generate_gaps_exit_2_naming_the_problem(run_dir, tmp_path, capsys, extra, message):
    assert eval_main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "x"), *NEEDLE, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "step(s) 3" in message:
        assert "complete steps: 1, 2" in err
    assert not (tmp_path / "x").exists()


def test_steps_refuse_a_single_step_folder(run_dir, tmp_path, capsys):
    one = run_dir / "checkpoints" / "step-2"
    assert eval_main(["--checkpoint", str(one), "--steps", "all", "--out", str(tmp_path), *NEEDLE]) == 2
    assert "--steps needs a run folder or its checkpoint folder; " in capsys.readouterr().err
