"""What a sweep says while a cell trains (its steps of the total, last loss, time left), and the eval command
it logs: one --trials, the user's when --eval-args set it."""

import json
import re
from pathlib import Path

import pytest

from atma_titan import sweep
from atma_titan.run.folder import RunFolder
from atma_titan.sweep import local, progress

ROOT = Path(__file__).resolve().parents[2]
BASE = "train_configs/debug_model.toml"


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # BASE is relative to the repository


def plan_with(eval_args: str) -> sweep.Plan:
    return sweep.build_plan(sweep.parse_plan_options(BASE, ["model.window=0,16"], [], eval_args))


@pytest.mark.parametrize(
    "eval_args, trials",
    [("", ["--trials", "256"]), ("--records --trials 16", ["--trials", "16"]), ("--trials=16 --records", [])],
)
def test_the_logged_eval_command_has_one_trials(eval_args, trials):
    plan = plan_with(eval_args)
    cmd = local.eval_command(plan, plan.cells[0], Path("/s"))
    assert sum(a == "--trials" or a.startswith("--trials=") for a in cmd) == 1, cmd
    if trials:
        i = cmd.index("--trials")
        assert cmd[i : i + 2] == trials
    else:
        assert "--trials=16" in cmd


def test_progress_says_steps_of_the_total_the_loss_and_the_time_left(tmp_path):
    run = RunFolder(tmp_path)
    (tmp_path / "config.toml").write_text("[training]\nsteps = 100\n")
    said, now = [], [0.0]
    watch = progress.TrainProgress(run, said.append, clock=lambda: now[0])
    watch.poll()  # nothing logged yet
    rows = [{"step": 10, "loss": 4.25}, {"step": 20, "loss": 3.5}]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "resume", "step": 0}) + "\n")
    for row, at in zip(rows, (0.0, 50.0)):
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        now[0] = at
        watch.poll()
        watch.poll()  # no new step: no line
    assert said == ["step 10/100, loss 4.2500", "step 20/100, loss 3.5000, 6m40s left"]  # 80 steps of 5 s


@pytest.mark.slow
def test_a_sweep_prints_each_cell_progress_while_it_trains(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.1)
    steps = ["--set", "training.steps=30", "--set", "training.seq_len=32", "--set", "training.batch_tokens=128"]
    steps += ["--set", "training.micro_batch_size=4", "--set", "metrics.log_freq=1"]
    args = ["run", "--base", BASE, "--out", str(tmp_path), "--factor", "model.window=0", *steps, "--no-eval"]
    assert sweep.main(args) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"^\[1/1\] window-0: step (\d+)/30, loss \d+\.\d{4}(, \S+ left)?$", out, re.M)
    assert len(lines) >= 2, out
    assert [int(step) for step, _ in lines] == sorted({int(step) for step, _ in lines})  # each step said once
    assert all(left for _, left in lines[1:]), out  # the pace is known from the second step seen
    assert out.index("window-0: training ...") < out.index("window-0: step ") < out.index("window-0: trained in")
