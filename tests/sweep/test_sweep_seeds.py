"""Training seeds in a sweep (--seeds: one run per job.seed, names, sweep.json, re-runs, the SLURM
array), their aggregation in collect (mean, range, std and n from hand-made finished runs), the
sweep's default evaluation trials, and the GPU-hour estimate of `sweep plan` from a given
throughput table. No training: the trainer and the eval command are stand-ins or not run."""

import csv
import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from atma_titan import sweep
from atma_titan.sweep import budget, local
from atma_titan.sweep.plan import validate_cell

ROOT = Path(__file__).resolve().parents[2]
BASE = "train_configs/debug_model.toml"
SMALL = ["--set", "training.steps=2", "--set", "training.seq_len=32", "--set", "training.batch_tokens=128"]
SMALL += ["--set", "training.micro_batch_size=4"]
FACTORS = ["--factor", "model.attention=polar,softmax", "--factor", "model.memory=true,false"]
CELLS = [f"attention-{a}_memory-{m}" for a in ("polar", "softmax") for m in ("true", "false")]
RUNS = [f"{c}_seed-{s}" for c in CELLS for s in (0, 1, 2)]


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def seeded_plan(seeds="0,1,2", factors=("model.attention=polar,softmax", "model.memory=true,false")):
    fixed = [s for s in SMALL if s != "--set"]
    return sweep.build_plan(sweep.parse_plan_options(BASE, list(factors), fixed, seeds=seeds))


class Stand_in:
    """`local.spawn`: 'trains' (metrics.jsonl + DONE, loss from the seed) and 'evaluates' (results.json)."""

    def __init__(self):
        self.calls: list[tuple[str, str, list[str]]] = []

    def __call__(self, cmd, log_path):
        stage = "train" if "atma_titan.train" in cmd else "eval"
        self.calls.append((stage, Path(log_path).parent.name, list(cmd)))
        if stage == "train":
            run = Path(cmd[cmd.index("--job.dump_folder") + 1])
            run.mkdir(parents=True, exist_ok=True)
            seed = int(cmd[cmd.index("--job.seed") + 1]) if "--job.seed" in cmd else 0
            (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 5.0 + seed}) + "\n")
            (run / "DONE").write_text("2\n")
        else:
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(results(cmd[cmd.index("--name") + 1], {128: (1.0, 1.0)})))
        return 0


def results(name: str, by_gap: dict[int, tuple[float, float]], depth=0.0, trials=256, curve=None) -> dict:
    """A results.json: {gap: (exact_acc, digit_acc)} (fractions, as the eval writes them)."""
    needle = [
        {"variant": "records", "gap": gap, "depth": depth, "trials": trials, "digit_acc": digit, "exact_acc": exact}
        | {"ce": None, "control_ce": None, "mode": "teacher_forced"}
        for gap, (exact, digit) in by_gap.items()
    ]
    return {"name": name, "checkpoint": "x", "step": 2, "tokenizer": "byte", "needle": needle, "length_curve": curve}


@pytest.fixture
def stand_in(monkeypatch):
    fake = Stand_in()
    monkeypatch.setattr(local, "spawn", fake)
    return fake


# ---- the plan ------------------------------------------------------------------------------------


def test_seeds_make_every_cell_a_set_of_runs_differing_only_in_job_seed():
    plan = seeded_plan()
    assert [c.name for c in plan.cells] == RUNS  # the seed varies fastest
    assert [c.index for c in plan.cells] == list(range(12))
    assert list(plan.groups) == CELLS and all(len(runs) == 3 for runs in plan.groups.values())
    assert plan.describe_runs() == "4 cells x 3 seeds (0,1,2) = 12 runs"
    first = plan.cells[:3]
    assert {c.group for c in first} == {CELLS[0]} and [c.seed for c in first] == [0, 1, 2]
    assert all(c.overrides == first[0].overrides for c in first)  # the factors' values are the cell's

    # The trainer's commands differ only in --job.seed, and so do the loaded configs.
    commands = [local.train_command(plan, c, Path("/s"), None) for c in first]
    for cmd, seed in zip(commands, (0, 1, 2)):
        assert cmd[cmd.index("--job.seed") + 1] == str(seed)
    masked = [[a if a not in ("0", "1", "2") or cmd[i - 1] != "--job.seed" else "S" for i, a in enumerate(cmd)]
              for cmd in commands]  # fmt: skip
    assert masked[0][: masked[0].index("--job.dump_folder")] == masked[2][: masked[2].index("--job.dump_folder")]
    configs = [validate_cell(plan.base, plan.fixed + list(c.config_overrides)) for c in first]
    assert [cfg.job.seed for cfg in configs] == [0, 1, 2]
    unseeded = [dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, seed=0)) for cfg in configs]
    assert unseeded[0] == unseeded[1] == unseeded[2]


def test_a_plan_without_seeds_is_unchanged():
    plan = seeded_plan(seeds=None)
    assert [c.name for c in plan.cells] == CELLS and plan.seeds is None
    assert all(c.seed is None and c.config_overrides == c.overrides for c in plan.cells)
    assert plan.to_json()["cells"][0] == {"index": 0, "name": CELLS[0], "overrides": dict(plan.cells[0].overrides)}
    cmd = local.train_command(plan, plan.cells[0], Path("/s"), None)
    assert "--job.seed" not in cmd


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--seeds", "0,x"], "--seeds '0,x': 'x' is not a non-negative integer"),
        (["--seeds", "1,2,1"], "--seeds '1,2,1': seed 1 is given twice"),
        (["--seeds", "-1"], "'-1' is not a non-negative integer"),
        (["--seeds", "0,1", "--factor", "job.seed=3,4"], "--factor job.seed: --seeds sets job.seed of every run"),
        (["--seeds", "0,1", "--set", "job.seed=3"], "--set job.seed: --seeds sets job.seed of every run"),
    ],
)
def test_bad_seeds_exit_2_before_anything_runs(tmp_path, capsys, extra, message):
    out = tmp_path / "sweep"
    assert sweep.main(["run", "--base", BASE, "--out", str(out), *FACTORS, *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_seeds_round_trip_through_sweep_json_and_old_plans_still_load(tmp_path):
    plan = seeded_plan()
    data = json.loads(json.dumps(plan.to_json()))
    assert data["version"] == 3 and data["seeds"] == [0, 1, 2]
    assert data["cells"][4] == {
        "index": 4,
        "name": RUNS[4],
        "overrides": {"model.attention": "polar", "model.memory": "false"},
        "group": CELLS[1],
        "seed": 1,
    }
    assert sweep.Plan.from_json(data) == plan
    # A version-2 plan (written before seeds existed) loads as a plan without seeds, the same plan.
    old = seeded_plan(seeds=None).to_json()
    old.pop("seeds")
    old["version"] = 2
    assert sweep.Plan.from_json(old) == seeded_plan(seeds=None)
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps(old))
    assert sweep.plan.check_plan(out, seeded_plan(seeds=None), force=False).cells == seeded_plan(seeds=None).cells
    with pytest.raises(sweep.SweepError, match=r"seeds: saved null, now \[0, 1, 2\]"):
        sweep.plan.check_plan(out, plan, force=False)  # other seeds: another plan (--force-plan keeps runs)


# ---- running, listing, SLURM ---------------------------------------------------------------------


def test_run_trains_every_seed_skips_finished_ones_and_lists_them(tmp_path, stand_in, capsys):
    out = tmp_path / "sweep"
    argv = ["run", "--base", BASE, "--out", str(out), *FACTORS, *SMALL, "--seeds", "0,1,2"]
    assert sweep.main(argv) == 0
    trained = [(name, cmd[cmd.index("--job.seed") + 1]) for stage, name, cmd in stand_in.calls if stage == "train"]
    assert trained == [(name, name[-1]) for name in RUNS]
    assert all((out / "cells" / name / "eval" / "results.json").is_file() for name in RUNS)

    stand_in.calls.clear()
    (out / "cells" / RUNS[7] / "eval" / "results.json").unlink()
    assert sweep.main(["run", "--out", str(out)]) == 0  # the saved plan: only the missing evaluation runs
    assert [(stage, name) for stage, name, _ in stand_in.calls] == [("eval", RUNS[7])]
    assert sweep.main(["run", "--out", str(out), "--cell", "5"]) == 0
    assert f"[6/12] {RUNS[5]}: done, skipping" in capsys.readouterr().out

    assert sweep.main(["list", "--out", str(out)]) == 0
    listing = capsys.readouterr().out
    assert "4 cells x 3 seeds (0,1,2) = 12 runs" in listing
    assert all(name in listing for name in RUNS) and listing.count(" done") == 12


def test_slurm_array_covers_every_cell_and_seed(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["slurm", "--base", BASE, "--out", str(out), *FACTORS, "--seeds", "0,1,2", "--dry-run"]
    assert sweep.main(argv) == 0
    line = shlex.split(capsys.readouterr().out)
    assert line[:2] == ["sbatch", "--array=0-11"] and "--seeds=0,1,2" in line
    assert not out.exists()


# ---- evaluation trials ---------------------------------------------------------------------------


def test_the_sweep_evaluates_with_256_trials_unless_eval_args_say_otherwise():
    from atma_titan.eval.__main__ import parse_args as eval_args

    plan = seeded_plan(seeds=None)
    cmd = local.eval_command(plan, plan.cells[0], Path("/s"))
    assert sweep.EVAL_TRIALS >= 256 and eval_args(cmd[3:]).trials == 256
    plan = dataclasses.replace(plan, eval_args="--records --trials 512")
    assert eval_args(local.eval_command(plan, plan.cells[0], Path("/s"))[3:]).trials == 512


# ---- collect over seeds --------------------------------------------------------------------------


def finish(out: Path, name: str, loss: float | None, result: dict | None) -> None:
    """A run folder as the trainer and the eval command leave it (DONE only when loss is given)."""
    run = out / "cells" / name / "run"
    run.mkdir(parents=True)
    if loss is not None:
        (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": loss}) + "\n")
        (run / "DONE").write_text("2\n")
    if result is not None:
        (out / "cells" / name / "eval").mkdir()
        (out / "cells" / name / "eval" / "results.json").write_text(json.dumps(result))


def test_collect_reports_mean_range_std_and_n_over_seeds(tmp_path, capsys):
    out = tmp_path / "sweep"
    sweep.plan.save_plan(out, seeded_plan(factors=("model.attention=polar,softmax",)), force=False)
    polar, softmax = "attention-polar", "attention-softmax"
    curve = lambda nll: {"lengths": [128, 256], "nll": nll, "documents": 2}  # noqa: E731
    # polar: three evaluated seeds; exact 5/5 at gap 128 = 100, 90, 80 %, at 4K 50, 60, 100 %
    for seed, (e128, e4k), loss, nll in [
        (0, (1.0, 0.5), 2.0, [3.0, 2.0]),
        (1, (0.9, 0.6), 2.5, [3.0, 2.5]),
        (2, (0.8, 1.0), 3.0, [3.0, 3.0]),
    ]:
        finish(out, f"{polar}_seed-{seed}", loss, results("x", {128: (e128, 1.0), 4096: (e4k, 0.9)}, curve=curve(nll)))
    # softmax: seed 0 evaluated, seed 1 trained only, seed 2 pending
    finish(out, f"{softmax}_seed-0", 4.0, results("x", {128: (0.25, 0.5), 4096: (0.0, 0.2)}))
    finish(out, f"{softmax}_seed-1", 6.0, None)
    finish(out, f"{softmax}_seed-2", None, None)

    assert sweep.main(["collect", "--out", str(out)]) == 0
    assert "collected 4 evaluated run(s) of 2 cells" in capsys.readouterr().out
    md = (out / "results.md").read_text()
    assert (
        "2 cells x 3 seeds (0,1,2) = 6 runs: 4 done, 1 trained, 1 pending. Needle trials per gap and depth: 256." in md
    )
    assert "| # | attention | seeds done | status | train loss |" in md
    assert "| 0 | polar | 3/3 | done | 2.5000 (2.0000-3.0000) |" in md
    assert "| 1 | softmax | 1/3 | 1 done, 1 trained, 1 pending | 5.0000 (4.0000-6.0000, n=2) |" in md
    exact = md.split("### Exact 5/5 recall (%): records, depth 0 (before the haystack), teacher-forced")[1]
    exact = exact.split("###")[0]
    assert "| # | attention | n | 128 | 4K |" in exact
    assert "| 0 | polar | 3 | 90.0 (80.0-100.0) | 70.0 (50.0-100.0) |" in exact
    assert "| 1 | softmax | 1 | 25.0 | 0.0 |" in exact
    nll = md.split("### Length curve: mean NLL per token (nats)")[1]
    assert "| 0 | polar | 3 | 3.000 (3.000-3.000) | 2.500 (2.000-3.000) |" in nll
    assert "| 1 | softmax | 1 | - | - |" in nll
    assert "range (min-max)" in md and "results_per_seed.csv" in md

    rows = {r["cell"]: r for r in csv.DictReader((out / "results.csv").open())}
    assert list(rows) == [polar, softmax]
    p = rows[polar]
    assert (p["seeds"], p["runs_done"], p["model.attention"]) == ("3", "3", "polar")
    assert float(p["exact_pct_records@128_mean"]) == pytest.approx(90.0)
    assert float(p["exact_pct_records@128_std"]) == pytest.approx(10.0)  # sample std of 100, 90, 80
    assert (float(p["exact_pct_records@4096_min"]), float(p["exact_pct_records@4096_max"])) == (50.0, 100.0)
    assert p["exact_pct_records@4096_n"] == "3" and float(p["digit_pct_records@4096_mean"]) == pytest.approx(90.0)
    assert float(p["nll@256_mean"]) == pytest.approx(2.5) and float(p["final_train_loss_std"]) == pytest.approx(0.5)
    s = rows[softmax]
    assert s["exact_pct_records@128_n"] == "1" and s["exact_pct_records@128_std"] == "" and s["nll@128_n"] == "0"

    per_seed = list(csv.DictReader((out / "results_per_seed.csv").open()))
    assert [(r["cell"], r["seed"], r["status"]) for r in per_seed] == [
        (polar, "0", "done"),
        (polar, "1", "done"),
        (polar, "2", "done"),
        (softmax, "0", "done"),
        (softmax, "1", "trained"),
        (softmax, "2", "pending"),
    ]
    assert [float(r["exact_pct_records@4096"]) for r in per_seed[:3]] == [50.0, 60.0, 100.0]
    assert per_seed[4]["exact_pct_records@4096"] == "" and per_seed[4]["final_train_loss"] == "6.0"


def test_the_plots_draw_each_cell_as_the_mean_of_its_seeds():
    runs = [results("a", {128: (1.0, 1.0), 4096: (0.5, 0.7)}), results("b", {128: (0.0, 0.4), 4096: (0.5, 0.9)})]
    runs[0]["length_curve"] = {"lengths": [128, 256], "nll": [3.0, 2.0], "documents": 2}
    runs[1]["length_curve"] = {"lengths": [128, 256], "nll": [2.0, 1.0], "documents": 2}
    mean = sweep.mean_results("cell", runs)
    assert mean["name"] == "cell" and mean["seeds"] == 2
    rows = {r["gap"]: r for r in mean["needle"]}
    assert rows[128]["exact_acc"] == 0.5 and rows[128]["digit_acc"] == pytest.approx(0.7)
    assert (rows[128]["exact_acc_min"], rows[128]["exact_acc_max"], rows[128]["trials"]) == (0.0, 1.0, 512)
    assert mean["length_curve"]["nll"] == [2.5, 1.5]
    spread = sweep.Spread.of([100.0, 90.0, 80.0])
    assert (spread.mean, spread.low, spread.high, spread.n) == (90.0, 80.0, 100.0, 3)
    assert spread.std == pytest.approx(10.0) and spread.text("{:.1f}", 3) == "90.0 (80.0-100.0)"
    assert spread.text("{:.1f}", 4) == "90.0 (80.0-100.0, n=3)"


# ---- the GPU-hour estimate -----------------------------------------------------------------------


def test_gpu_hours_from_a_given_throughput_table():
    table = sweep.parse_throughput(
        {
            "reference": {"flops_per_token": 1e9, "label": "ref"},
            "gpus": {"H200": {"tokens_per_s": 1000, "basis": "measured here"}, "L4": {"scale_from": "H200"}},
        }
    )
    assert [(g.kind, g.measured) for g in table.gpus] == [("H200", True), ("L4", False)]
    assert table.gpus[1].tokens_per_s == pytest.approx(1000 * 121 / 989)
    assert "estimate, not measured: H200 x 121/989" in table.gpus[1].basis
    # 3 runs of 3.6M tokens at the reference's FLOPs: 3 x 1 h on the H200; twice the FLOPs: half the tokens/s.
    a, b = sweep.estimate([("a", 3, 3_600_000, 1e9), ("b", 1, 3_600_000, 2e9)], table)
    assert a.hours["H200"] == pytest.approx(3.0) and b.hours["H200"] == pytest.approx(2.0)
    assert a.hours["L4"] == pytest.approx(3.0 * 989 / 121) and not a.small
    tiny = sweep.estimate([("t", 1, 3_600_000, 1e7)], table)[0]
    assert tiny.small and tiny.hours["H200"] == pytest.approx(0.01)


def test_builtin_table_is_the_measured_h200_and_scaled_h100_l4():
    table = sweep.parse_throughput(sweep.BUILTIN_THROUGHPUT)
    by_kind = {g.kind: g for g in table.gpus}
    h200 = budget.H200_RECIPE_TOKENS_PER_S  # the measurement it cites: the next test
    assert by_kind["H200"].measured and by_kind["H200"].tokens_per_s == h200
    assert not by_kind["H100"].measured and by_kind["H100"].tokens_per_s == pytest.approx(h200)  # 989 / 989
    assert not by_kind["L4"].measured and by_kind["L4"].tokens_per_s == pytest.approx(h200 * 121 / 989)
    assert "train_speed-h200-2026-12-03.json" in by_kind["H200"].basis
    assert table.reference_label == "atma_370m at 2,048 tokens" and 1.9e9 < table.reference_flops < 2.2e9


def test_builtin_h200_figures_are_the_measurement_they_cite():
    """The built-in tokens/s are the recipe and one-micro-batch rows of the benchmark file named as their basis."""
    rows = json.loads((ROOT / budget.H200_MEASUREMENT).read_text())["results"]
    measured = {row["variant"]: round(row["tokens_per_second"]) for row in rows}
    assert measured["compile+selective"] == budget.H200_RECIPE_TOKENS_PER_S
    assert measured["compile+selective+step32k"] == budget.H200_ONE_MICRO_BATCH_TOKENS_PER_S


def test_plan_command_prints_hours_per_cell_and_total_and_writes_nothing(tmp_path, capsys):
    table = tmp_path / "throughput.json"
    # The reference is the cells' own model (debug flavor at 32 tokens): hours = tokens / tokens/s exactly.
    table.write_text(
        json.dumps({"reference": {"flavor": "debug", "seq_len": 32}, "gpus": {"H200": {"tokens_per_s": 64}}})
    )
    out = tmp_path / "sweep"
    argv = ["plan", "--base", BASE, "--out", str(out), *FACTORS, *SMALL, "--seeds", "0,1,2"]
    assert sweep.main([*argv, "--throughput", str(table)]) == 0
    text = capsys.readouterr().out
    assert "GPU-hour estimate for sweep" in text and "4 cells x 3 seeds (0,1,2) = 12 runs" in text
    # polar + memory is the debug flavor itself: 3 runs x 2 steps x 128 tokens / 64 tokens/s = 12 s.
    line = next(line for line in text.splitlines() if line.split()[:2] == ["0", CELLS[0]])
    assert line.split()[2:4] == ["3", "256"] and float(line.split()[-1]) == pytest.approx(12 / 3600, rel=0.02)
    total = next(line for line in text.splitlines() if line.split()[:1] == ["total"])
    assert total.split()[1] == "12" and float(total.split()[-1]) > 0
    assert not out.exists()

    table.write_text(json.dumps({"reference": {"flavor": "debug", "seq_len": 32}, "gpus": {"L4": {"scale_from": "X"}}}))
    assert sweep.main([*argv, "--throughput", str(table)]) == 2
    assert "gpus.L4.scale_from 'X' is not a measured kind" in capsys.readouterr().err
