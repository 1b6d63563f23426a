"""benchmarks/train/length_map.py: every sweep of the length map plans and its cells train a step; the
printed commands; the report's tables and plots on hand-written results."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "train"))

import length_map  # noqa: E402

from atma_titan.config import load_config  # noqa: E402
from atma_titan.sweep.plan import build_plan, config_argv, parse_plan_options  # noqa: E402
from atma_titan.train import train  # noqa: E402


def plan_of(sweep: length_map.Sweep):
    base = str(ROOT / sweep.base)
    return build_plan(parse_plan_options(base, list(sweep.factors), sweep.fixed(), sweep.eval_args(), seeds="0"))


@pytest.mark.slow
@pytest.mark.parametrize("sweep", length_map.SWEEPS, ids=lambda s: s.name)
def test_every_cell_of_every_sweep_trains_a_step(sweep, tmp_path):
    plan = plan_of(sweep)
    assert len(plan.cells) == len(set(c.group for c in plan.cells)) >= 1
    for cell in plan.cells:
        overrides = plan.fixed + list(cell.config_overrides)
        cfg = load_config(config_argv(plan.base, overrides))
        assert cfg.training.seq_len == sweep.seq_len and cfg.checkpoint.keep_latest_k == 0
        assert sweep.base != length_map.TOY or cfg.training.batch_tokens == length_map.TOY_BATCH
        tiny = ["--training.steps", "1", "--training.batch_tokens", str(sweep.seq_len), "--training.micro_batch_size",
                "1", "--checkpoint.enable", "false", "--metrics.stdout", "false", "--job.print_config", "false",
                "--job.dump_folder", str(tmp_path / cell.name)]  # fmt: skip
        if sweep.base != length_map.TOY:  # the 370M's blocks, narrowed: a step of them is minutes on a CPU
            tiny += ["--model.d_model", "64", "--model.head_dim", "16", "--model.mlp_hidden", "128",
                     "--training.compile", "false"]  # fmt: skip
        last = train(load_config(config_argv(plan.base, overrides) + tiny))
        assert last["step"] == 1 and last["loss"] == last["loss"]  # finite


def test_commands_are_one_line_per_sweep_with_its_evaluations():
    lines = length_map.commands("sweeps/map", {1, 2, 3, 4, 5}, jobs=4)
    assert len(lines) == len(length_map.SWEEPS)
    by_name = {line.split("--out sweeps/map/")[1].split()[0]: line for line in lines}
    first = shlex.split(by_name["length-2048"].split(" && ")[0])
    assert first[:4] == ["python", "-m", "atma_titan.sweep", "run"] and "training.seq_len=2048" in first
    eval_args = first[first.index("--eval-args") + 1]
    assert "--gaps 2048,16384,65536" in eval_args and "--generate-gaps 65536" in eval_args
    assert "--steps all --gaps 2048,65536" in by_name["length-2048"].split(" && ")[1]  # every checkpoint too
    assert " && " not in by_name["length-512"] and "--steps all" in by_name["time-2048-unit"]
    assert by_name["length-2048"].endswith("& done; wait")  # the runs' checkpoints evaluated at once
    # a checkpoint at every tenth only where recall over training reads them, else the last alone
    assert "checkpoint.interval=150" in by_name["length-2048"]
    assert "checkpoint.interval=50" in by_name["time-2048-short"]
    assert "checkpoint.interval=1500" in by_name["length-512"] and "checkpoint.interval=1500" in by_name["width-1024"]
    # questions 3 and 4: each 370M body at its own length, the toy cells' evaluation of its last checkpoint,
    # then every fifth of its 763 steps at 1x, 4x and 32x
    for name, factor, cell in (("time-370m", "model.attention=polar", "attention-polar"),
                               ("global-370m", 'model.global_layers="14"', "global_layers-14")):  # fmt: skip
        body, its_steps = by_name[name].split(" && ")
        body = shlex.split(body)
        assert body[body.index("--base") + 1] == length_map.BODY_370M and "training.seq_len=2048" not in body
        assert body[body.index("--factor") + 1] == factor
        assert body[body.index("--seeds") + 1] == "0,1" and "checkpoint.interval=153" in body
        assert "--gaps 2048,16384,65536 --depths 0,0.5" in body[body.index("--eval-args") + 1]
        cells = f"sweeps/map/{name}/cells/{cell}_seed-"
        assert f"for cell in {cells}0 {cells}1;" in its_steps
        assert "--steps all --gaps 2048,8192,65536" in its_steps
    assert "optimizer.matrix_lr=0.00025" in by_name["width-1024"]  # 1e-3 x 256 / 1,024
    # a seed added to a finished map: that seed's runs alone, trained and evaluated
    (one_more,) = length_map.commands("m", {3, 4}, 1, seeds="1", names={"global-370m"})
    assert " --seeds 1 " in one_more and "for cell in m/global-370m/cells/global_layers-14_seed-1;" in one_more
    assert list(length_map.commands("m", {5}, 1)) == [by_name["documents-128"].replace("sweeps/map", "m")
                                                      .replace("--jobs 4", "--jobs 1")]  # fmt: skip


def _run(folder: Path, group: str, seed: int, train_len: int, exact: dict, steps: list[tuple[int, float]] = ()):
    needle = [
        {"variant": "records", "gap": int(g * train_len), "depth": d, "trials": 4, "digit_acc": v, "exact_acc": v,
         "ce": None, "control_ce": None, "mode": mode}
        for (g, d, mode), v in exact.items()
    ]  # fmt: skip
    cell = folder / "cells" / f"{group}_seed-{seed}"
    (cell / "eval").mkdir(parents=True)
    (cell / "run").mkdir()
    (cell / "run" / "DONE").touch()
    logged = [{"event": "start"}, {"step": 1500, "loss": 2.5 + seed}, {"event": "end"}]
    (cell / "run" / "metrics.jsonl").write_text("\n".join(map(json.dumps, logged)) + "\n")
    result = {"train_seq_len": train_len, "needle": needle, "length_curve": None}
    if steps:
        result["over_training"] = [
            {"step": s, "needle": [dict(needle[0], gap=32 * train_len, exact_acc=v)]} for s, v in steps
        ]
    (cell / "eval" / "results.json").write_text(json.dumps(result))
    return {"index": seed, "name": cell.name, "overrides": {}, "group": group, "seed": seed}


def test_report_tables_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    sweeps = {s.name: s for s in length_map.SWEEPS}
    cells = {name: [] for name in ("length-128", "length-2048", "time-2048-short", "time-370m", "global-370m")}
    for seed, value in ((0, 0.9), (1, 0.7)):
        exact = {(32, 0.0, "teacher_forced"): value, (32, 0.0, "generated"): value / 2, (1, 0.0, "teacher_forced"): 1.0}
        cells["length-128"].append(_run(tmp_path / "length-128", "attention-polar", seed, 128, exact))
        cells["length-2048"].append(_run(tmp_path / "length-2048", "attention-polar", seed, 2048, exact,
                                         [(150, 0.5), (1500, value)]))  # fmt: skip
        cells["time-2048-short"].append(_run(tmp_path / "time-2048-short", "steps-500", seed, 2048, exact,
                                             [(50, 0.0), (500, 0.25)]))  # fmt: skip
        cells["global-370m"].append(_run(tmp_path / "global-370m", "global_layers-14", seed, 2048, exact,
                                         [(153, 0.0), (306, 0.75), (763, value)]))  # fmt: skip
        four = {key: v / 4 for key, v in exact.items()}
        cells["time-370m"].append(_run(tmp_path / "time-370m", "attention-polar", seed, 2048, four,
                                       [(153, 0.0), (763, value / 4)]))  # fmt: skip
    for name, runs in cells.items():
        (tmp_path / name / "sweep.json").write_text(json.dumps({"cells": runs}))
    runs = length_map.load_runs(tmp_path)
    assert {r["sweep"] for r in runs} == set(cells) and all(sweeps[r["sweep"]] for r in runs)
    written = length_map.write_report(runs, tmp_path / "report")
    md = written[0].read_text()
    lengths = md[md.index("## 1. Training length") :].splitlines()
    row = next(line for line in lengths if line.startswith("| length-128 | attention-polar |"))
    assert "| 80.0 (70.0-90.0) |" in row and "| 40.0 (35.0-45.0) |" in row  # teacher and generated at 32x
    over = md[md.index("over training, depth 0: 32x") :].split("\n\n")[1]
    assert "| length-2048 | attention-polar | 2 | 50.0 (50.0-50.0) |" in over  # step 150 is the first tenth
    assert "| time-2048-short | steps-500 | 2 | 0.0 (0.0-0.0) |" in over and "25.0 (25.0-25.0) |" in over
    # question 4's runs read over training too: 306 of 763 steps is the fourth tenth
    assert "| global-370m | global_layers-14 | 2 | - | 0.0 (0.0-0.0) | - | 75.0 (75.0-75.0) |" in over
    # question 4's table sets the four-global body of question 3 beside the one-global body
    bodies = md[md.index("## 4.") :].split("\n\n")[1].splitlines()[2:]
    assert bodies[0].startswith("| time-370m | attention-polar | 2 | 25.0 (25.0-25.0) |")
    assert bodies[1].startswith("| global-370m | global_layers-14 | 2 | 100.0 (100.0-100.0) |") and len(bodies) == 2
    assert "| time-370m |" not in md[md.index("## 1.") : md.index("## 3.")]  # and in no other question's
    assert "4x (the 370M bodies)\n\nNo run of this question" in md  # no row of dashes for cells not measured at 4x
    assert "| length-128 | attention-polar | 2 | 1500 | 3.00 (2.50-3.50) |" in md  # the final losses
    assert md.count("| time-370m | attention-polar | 2 | 1500 |") == 1  # a cell of two questions' tables once
    assert [p.name for p in written[2:]] == ["recall_vs_train_length.png", "recall_over_training.png"]
    assert all(p.stat().st_size > 0 for p in written)


def test_report_keeps_earlier_runs_that_no_later_sweep_holds(tmp_path):
    run = {"sweep": "length-128", "cell": "attention-polar", "seed": 0, "recall": {"32x d0": 1.0}}
    earlier = tmp_path / "length_map.json"
    earlier.write_text(json.dumps([run, dict(run, seed=1)]))
    again = dict(run, recall={"32x d0": 2.0})
    merged = length_map.with_previous([again], [earlier])
    assert merged == [again, dict(run, seed=1)]  # seed 0 trained again replaces the earlier one


def test_report_says_what_it_read_and_names_runs_without_done(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    exact = {(32, 0.0, "teacher_forced"): 1.0}
    runs = [_run(tmp_path / "length-128", "attention-polar", seed, 128, exact) for seed in (0, 1)]
    (tmp_path / "length-128" / "sweep.json").write_text(json.dumps({"cells": runs}))
    (tmp_path / "length-128" / "cells" / "attention-polar_seed-1" / "run" / "DONE").unlink()  # copied without it
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps([{"sweep": "length-128", "cell": "attention-polar", "seed": 2, "question": 1,
                                    "train_len": 128, "final_step": 1500, "final_loss": 2.5,
                                    "recall": {"32x d0": 90.0}, "nll": {}, "over_training": []}]))  # fmt: skip
    assert length_map.main(["report", "--out", str(tmp_path), "--results", str(tmp_path / "r"),
                            "--previous", str(earlier)]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert "left out length-128/attention-polar_seed-1: its run has no run/DONE" in err
    assert f"1 run(s) from {tmp_path}, 1 kept from --previous" in out
    assert "| length-128 | attention-polar | 2 |" in (tmp_path / "r" / "length_map.md").read_text()


def test_report_names_a_missing_previous_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        length_map.main(["report", "--out", str(tmp_path), "--results", str(tmp_path / "r"),
                         "--previous", str(tmp_path / "missing.json")])  # fmt: skip
    assert exit_.value.code == 2 and "missing.json: no such file" in capsys.readouterr().err


@pytest.mark.parametrize(("questions", "message"), [("7", "no sweep answers question(s) [7]"), ("a", "numbers")])
def test_commands_name_bad_questions(questions, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        length_map.main(["commands", "--questions", questions])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--seeds", "one"], "--seeds 'one': 'one' is not a non-negative integer"),
     (["--seeds", "1,1"], "--seeds '1,1': seed 1 is given twice"),
     (["--sweeps", "time-370m,depth-9"], "no sweep named depth-9; choose from length-128, ")],
)  # fmt: skip
def test_commands_name_bad_seeds_and_sweeps(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        length_map.main(["commands", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
