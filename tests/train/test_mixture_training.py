"""Training on a mixture ([[data.sources]], [[data.stages]]): the per-source counters count the windows trained, a
stage switches the mixture (and lr_scheduler.decay_stage the learning rate) at its step, a run resumes exactly
after a SIGTERM and continues at another world size, and bad mixtures exit 2 before anything is written."""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from atma_titan.config import JobConfig, load_config, load_toml
from atma_titan.data import SyntheticSource
from atma_titan.data.mixture import MixtureSchedule, parse_mixture
from atma_titan.data.mixture_batches import build_mixture_dataloader
from atma_titan.data.mixture_data import MixtureState, open_train_data
from atma_titan.data.shards import BinShards, write_shard
from atma_titan.data.tokenizer import build_tokenizer
from atma_titan.train import train
from distributed_utils import ROOT, losses, run_trainer
from mixture_tables import source, stage

EOT = build_tokenizer("byte").eot_id
VOCAB = 512  # the debug flavor's
SEQ, BATCH_TOKENS, MICRO = 32, 512, 4
GLOBAL = BATCH_TOKENS // SEQ  # 16 windows a step

BASE = f"""
[job]
seed = 0
print_config = false

[model]
flavor = "debug"

[training]
seq_len = {SEQ}
batch_tokens = {BATCH_TOKENS}
micro_batch_size = {MICRO}
device = "cpu"

[metrics]
log_freq = 1
stdout = false

[checkpoint]
enable = true
interval = 100

[data]
tokenizer = "byte"
seed = 7
"""


def config_text(steps: int, *tables: str, extra: str = "") -> str:
    """BASE with training.steps, then `extra` sections, then the [[data.sources]] / [[data.stages]] tables."""
    text = BASE.replace('device = "cpu"', f'device = "cpu"\nsteps = {steps}')
    return text + extra + "".join(tables)


def shard(folder: Path) -> str:
    """One .bin shard of byte-tokenizer ids with an EOT every ~20 tokens (no manifest: nothing to check)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, 6000)
    tokens[rng.random(6000) < 0.05] = EOT
    write_shard(str(folder / "web_000.bin"), tokens)
    return str(folder / "web_*.bin")


def rows(folder: Path) -> dict[int, dict]:
    """The step rows of metrics.jsonl by step (a resumed run appends: later rows win; events are left out)."""
    out = {}
    for line in (Path(folder) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row
    return out


def counts(row: dict, names) -> dict:
    return {f"{key}/{n}": row[f"{key}/{n}"] for key in ("tokens", "documents") for n in names}


# ---------------------------------------------------------------------------------------------------------
# One run: counters, the stage switch, the lr decay, the resume


STEPS, SOLO_STEP = 6, 4  # stage "solo" (only source b) trains steps 4..6
NAMES = ["a", "b", "web"]


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory):
    """6 steps on two synthetic languages and a .bin shard (weights 2:1:1), then from step 4 on b alone, with the
    learning rate decaying from that stage."""
    folder = tmp_path_factory.mktemp("mixture")
    pattern = shard(folder)
    tables = [
        source("a", "synthetic", 2, seed=1),
        source("b", "synthetic", 1, seed=2),
        source("web", "bin", 1, path=pattern),
        stage("solo", SOLO_STEP, "b = 1"),
    ]
    extra = '\n[lr_scheduler]\nname = "constant_then_linear"\ndecay_stage = "solo"\n'
    (folder / "mix.toml").write_text(config_text(STEPS, *tables, extra=extra))
    train(load_config(["--config", str(folder / "mix.toml"), "--job.dump_folder", str(folder / "run")]))
    return folder, pattern


def count_windows(cfg, pattern: str, steps: int) -> dict[int, dict]:
    """Per step, the cumulative tokens/<source> and documents/<source> of the windows a loader of the run's mixture
    gives (built here from the sources the config names; documents = EOT ids among the inputs)."""
    spec = parse_mixture(cfg.data, cfg.training.steps)
    sources = [SyntheticSource(VOCAB, eot_id=EOT, seed=1), SyntheticSource(VOCAB, eot_id=EOT, seed=2)]
    sources.append(BinShards(pattern, vocab_size=VOCAB))
    loader = iter(build_mixture_dataloader(MixtureSchedule(spec, GLOBAL), sources, SEQ, GLOBAL, MICRO))
    total = {f"{key}/{n}": 0 for key in ("tokens", "documents") for n in NAMES}
    out = {}
    for step in range(1, steps + 1):
        for _ in range(GLOBAL // MICRO):
            inputs, _, drawn = next(loader)
            for row, s in zip(inputs, drawn.tolist()):
                total[f"tokens/{NAMES[s]}"] += SEQ
                total[f"documents/{NAMES[s]}"] += int((row == EOT).sum())
        out[step] = dict(total)
    return out


def test_per_source_counters_are_a_count_of_the_windows_trained(mixture_run):
    folder, pattern = mixture_run
    logged = rows(folder / "run")
    assert list(logged) == list(range(1, STEPS + 1))
    expected = count_windows(load_config(["--config", str(folder / "mix.toml")]), pattern, STEPS)
    for step in logged:
        assert counts(logged[step], NAMES) == expected[step], step
    last = expected[STEPS]
    assert sum(last[f"tokens/{n}"] for n in NAMES) == STEPS * BATCH_TOKENS
    assert all(last[f"documents/{n}"] > 0 for n in NAMES)  # every source's windows hold documents


def test_a_stage_switches_the_mixture_and_starts_the_lr_decay_at_its_step(mixture_run):
    folder, _ = mixture_run
    logged = rows(folder / "run")
    tokens = {n: [0] + [logged[s][f"tokens/{n}"] for s in range(1, STEPS + 1)] for n in NAMES}
    per_step = {n: np.diff(tokens[n]) for n in NAMES}  # per_step[n][s - 1]: step s's tokens of n
    for s in range(1, SOLO_STEP):  # the main stage: every source
        assert all(per_step[n][s - 1] > 0 for n in NAMES), (s, {n: per_step[n][s - 1] for n in NAMES})
    for s in range(SOLO_STEP, STEPS + 1):  # stage solo: b alone
        assert [per_step[n][s - 1] for n in NAMES] == [0, BATCH_TOKENS, 0], s
    # constant_then_linear decays from the stage's start (not decay_start = 0.3 of the steps, i.e. after step 1):
    # the peak up to step 4, then linearly towards 0 at the end.
    lr = {s: logged[s]["lr"] for s in logged}
    peak = lr[1]
    for s in range(1, STEPS + 1):
        want = peak * (1 - max(0, s - SOLO_STEP) / (STEPS - SOLO_STEP + 1))
        assert lr[s] == pytest.approx(want, rel=1e-6), (s, lr)
    assert lr[SOLO_STEP + 1] < lr[SOLO_STEP] == lr[1]


def test_a_mixture_run_resumes_from_its_saved_config(mixture_run, tmp_path, capsys):
    """The saved config.toml (the mixture as inline tables) re-reads as the same mixture, so a resume of the run is
    not refused, and its counters continue from the checkpoint's."""
    folder, pattern = mixture_run
    saved = JobConfig()
    load_toml(saved, folder / "run" / "config.toml")
    cfg = load_config(["--config", str(folder / "mix.toml")])
    assert saved.data.sources == cfg.data.sources and saved.data.stages == cfg.data.stages
    assert len(saved.data.sources) == 3 and saved.lr_scheduler.decay_stage == "solo"
    shutil.copytree(folder / "run", tmp_path / "run")
    longer = ["--config", str(folder / "mix.toml"), "--job.dump_folder", str(tmp_path / "run")]
    longer += ["--training.steps", "8", "--metrics.stdout", "true"]
    train(load_config(longer))
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 6" in out, out[-2000:]
    logged = rows(tmp_path / "run")
    assert list(logged) == list(range(1, 9))
    assert counts(logged[8], NAMES) == count_windows(load_config(longer), pattern, 8)[8]


# ---------------------------------------------------------------------------------------------------------
# Bad input


def bad_shards(folder: Path) -> str:
    """A shard whose manifest.json says another tokenizer (gpt2) made it than the run's (byte)."""
    pattern = shard(folder)
    manifest = {"tokenizer": {"name": "gpt2", "vocab_size": 50257, "eot_id": 50256}, "shards": ["web_000.bin"]}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return pattern


TWO = source("a", "synthetic", 1) + source("b", "synthetic", 1)
# case: the mixture's tables, and what the one line of the error must say (the key and its value).
BAD = {
    "negative weight": (source("a", "synthetic", -1) + source("b", "synthetic", 1), "'data.sources[0].weight' = -1.0"),
    "all weights zero": (
        source("a", "synthetic", 0) + source("b", "synthetic", 0),
        "'data.sources[].weight' = [0.0, 0.0]",
    ),
    "nan weight": (source("a", "synthetic", 1) + source("b", "synthetic", "nan"), "'data.sources[1].weight' = nan"),
    "a name twice": (source("a", "synthetic", 1) + source("a", "synthetic", 1), "'data.sources[1].name' = 'a'"),
    "a stage after the run": (TWO + stage("late", 9, "b = 1"), "'data.stages[0].start_step' = 9"),
    "a stage at the main stage's step": (TWO + stage("late", 1, "b = 1"), "'data.stages[0].start_step' = 1"),
    "a stage before the previous": (
        TWO + stage("late", 3, "b = 1") + stage("early", 2, "a = 1"),
        "'data.stages[1].start_step' = 2",
    ),
    "an unknown source in a stage": (TWO + stage("late", 2, "c = 1"), "'data.stages[0].weights.c' = 1"),
    "a manifest of another tokenizer": (None, "tokenizer 'gpt2'"),  # and data.tokenizer is 'byte'
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_mixture_exits_2_naming_the_file_key_and_value_before_writing(tmp_path, case):
    tables, said = BAD[case]
    config = tmp_path / "bad.toml"
    named, manifest = str(config), tables is None
    if manifest:  # the shards' manifest.json disagrees with data.tokenizer
        tables = source("web", "bin", 1, path=bad_shards(tmp_path)) + source("b", "synthetic", 1)
        named = f"manifest.json beside {tmp_path / 'web_*.bin'}"
    config.write_text(config_text(3, tables))
    run_folder = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "atma_titan.train", "--config", str(config), "--job.dump_folder", str(run_folder)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    message = lines[0]
    assert named in message and said in message, message
    if manifest:
        assert "data.tokenizer is 'byte'" in message, message
    assert not run_folder.exists()  # the data is opened before the run folder is locked or written


# ---------------------------------------------------------------------------------------------------------
# SIGTERM and resume under torchrun (2 gloo ranks), and at another world size

FILES, PER_FILE, FIRST_ID = 3, 30, ord("!")  # document (f, d) begins with the character FIRST_ID + f * PER_FILE + d


def id_corpus(folder: Path) -> str:
    """Text documents, each opening with its own one-byte id character, then 5-25 filler words."""
    folder.mkdir()
    rng = random.Random(0)
    for f in range(FILES):
        with open(folder / f"part{f}.jsonl", "w") as out:
            for d in range(PER_FILE):
                text = chr(FIRST_ID + f * PER_FILE + d) + " w" * rng.randint(5, 25)
                out.write(json.dumps({"text": text}) + "\n")
    return str(folder / "*.jsonl")


def run_recorded(nproc: int, record: Path, *args: str) -> subprocess.CompletedProcess:
    """The trainer recording each rank's micro-batches (tests/support/record_batches.py), on `nproc` ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, str(ROOT / "tests" / "support" / "record_batches.py"), str(record), *args]
    return ok(subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300))


def recorded_windows(record: Path, spec, world: int, first_step: int) -> list[tuple[int, np.ndarray]]:
    """(source, window) of every micro-batch row the ranks' loops took, the source drawn for its global window."""
    schedule = MixtureSchedule(spec, GLOBAL)
    per_rank = GLOBAL // world
    accum = per_rank // MICRO
    out = []
    for rank in range(world):
        batches = [json.loads(line) for line in (record / f"rank-{rank}.jsonl").read_text().splitlines()]
        for j, batch in enumerate(batches):
            step = first_step + j // accum
            first = (step - 1) * GLOBAL + rank * per_rank + (j % accum) * MICRO
            out += list(zip(schedule.sources(first, MICRO).tolist(), map(np.asarray, batch)))
    return out


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


# Bit-identical losses on a resume at the same world size; one loader worker per rank (its state is restored).
EXACT = ["--job.deterministic", "true", "--data.num_workers", "1"]


def test_sigterm_mid_stage_resumes_exactly_and_a_text_mixture_continues_on_one_rank(tmp_path):
    """Synthetic + .bin + text, stage "late" from step 4, stopped by SIGTERM after step 5 on 2 ranks: resumed on 2
    ranks it trains the straight run's losses and counts bit for bit; a copy resumed on 1 rank continues from the
    text's document cursor and trains no document twice."""
    text = id_corpus(tmp_path / "text")
    tables = [
        source("syn", "synthetic", 1, seed=1),
        source("web", "bin", 1, path=shard(tmp_path)),
        source("txt", "text", 1, path=text),
        stage("late", 4, "syn = 1, web = 1, txt = 3"),
    ]
    config = tmp_path / "mix.toml"
    config.write_text(config_text(7, *tables))
    common = ["--config", str(config), *EXACT]
    names = ["syn", "web", "txt"]
    ok(run_trainer(2, *common, "--job.dump_folder", str(tmp_path / "straight")))
    stopped = run_recorded(
        2, tmp_path / "rec-1", *common, "--job.dump_folder", str(tmp_path / "split"), "--debug.signal_at_step", "5"
    )
    assert "received SIGTERM" in stopped.stderr
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == ["step-5"]
    shutil.copytree(tmp_path / "split", tmp_path / "moved")
    ok(run_trainer(2, *common, "--job.dump_folder", str(tmp_path / "split")))
    straight, split = rows(tmp_path / "straight"), rows(tmp_path / "split")
    assert [split[s]["loss"] for s in (6, 7)] == [straight[s]["loss"] for s in (6, 7)]  # bit-identical
    for s in range(1, 8):
        assert counts(split[s], names) == counts(straight[s], names), s

    moved = run_recorded(1, tmp_path / "rec-2", *common, "--job.dump_folder", str(tmp_path / "moved"))
    assert "resumed from" in moved.stdout and "at step 5" in moved.stdout and "document cursors" in moved.stdout
    assert list(losses(tmp_path / "moved")) == list(range(1, 8))
    spec = parse_mixture(load_config(common).data, 7)
    assert spec.stage_at(5).name == "late" and spec.stage_at(3).name == "main"  # stopped inside the second stage
    windows = recorded_windows(tmp_path / "rec-1", spec, 2, 1) + recorded_windows(tmp_path / "rec-2", spec, 1, 6)
    assert len(windows) == 7 * GLOBAL
    documents, tokens = {n: 0 for n in names}, {n: 0 for n in names}
    trained = []  # the text documents whose leading EOT was an input token, by id
    for s, window in windows:
        starts = np.flatnonzero(window[:-1] == EOT)
        documents[names[s]] += len(starts)
        tokens[names[s]] += SEQ
        if names[s] == "txt":
            trained += [int(window[p + 1]) - FIRST_ID for p in starts]
    last = rows(tmp_path / "moved")[7]
    assert {n: last[f"documents/{n}"] for n in names} == documents  # the counters survive the move
    assert {n: last[f"tokens/{n}"] for n in names} == tokens
    assert len(trained) > 20 and len(trained) == len(set(trained)), "a document was trained twice"
    for f in range(FILES):  # each file is read in order, one part at a time: what was trained of it is a prefix
        mine = sorted(d - f * PER_FILE for d in trained if d // PER_FILE == f)
        assert mine == list(range(len(mine))), f"file {f}: {mine}"


def test_a_synthetic_and_bin_mixture_saved_on_2_ranks_resumes_on_1_with_the_straight_losses(tmp_path):
    tables = [
        source("syn", "synthetic", 1, seed=1),
        source("web", "bin", 1, path=shard(tmp_path)),
        stage("late", 4, "syn = 1, web = 4"),
    ]
    config = tmp_path / "mix.toml"
    config.write_text(config_text(7, *tables))
    common = ["--config", str(config), *EXACT]
    ok(run_trainer(1, *common, "--job.dump_folder", str(tmp_path / "straight")))
    ok(run_trainer(2, *common, "--job.dump_folder", str(tmp_path / "moved"), "--debug.signal_at_step", "5"))
    resumed = ok(run_trainer(1, *common, "--job.dump_folder", str(tmp_path / "moved")))
    assert "resumed from" in resumed.stdout and "at step 5" in resumed.stdout
    straight, moved = rows(tmp_path / "straight"), rows(tmp_path / "moved")
    for s in (6, 7):
        assert moved[s]["loss"] == pytest.approx(straight[s]["loss"], rel=1e-4), s
    assert counts(moved[7], ["syn", "web"]) == counts(straight[7], ["syn", "web"])


# ---------------------------------------------------------------------------------------------------------
# Sources that run out, and validation per source


def test_sources_that_run_out_start_another_pass_and_the_checkpoint_counts_the_passes(tmp_path):
    """A .bin source wraps around to its first window (its windows repeat, pass after pass); a text source starts
    another pass over its documents; the checkpoint's mixture entry holds the passes made over each."""
    write_shard(str(tmp_path / "tiny_000.bin"), np.arange(200) % 250)  # 6 windows of 33 tokens a pass
    per_pass = (200 - 1) // SEQ
    with open(tmp_path / "notes.jsonl", "w") as out:
        for d in range(3):
            out.write(json.dumps({"text": f"note {d}: short."}) + "\n")
    tables = [
        source("tiny", "bin", 1, path=str(tmp_path / "tiny_*.bin")),
        source("notes", "text", 1, path=str(tmp_path / "notes.jsonl")),
    ]
    (tmp_path / "mix.toml").write_text(config_text(4, *tables))
    cfg = load_config(["--config", str(tmp_path / "mix.toml")])
    data = open_train_data(cfg.data, VOCAB, cfg.training.steps)
    loader = iter(
        data.loader(seq_len=SEQ, global_batch=GLOBAL, micro_batch=MICRO, rank=0, world_size=1, start_window=0,
                    pin_memory=False)
    )  # fmt: skip
    tiny = []
    for _ in range(4 * GLOBAL // MICRO):
        inputs, labels, drawn = next(loader)
        data.counts.add(drawn, inputs)
        tiny += [torch.cat([i, l[-1:]]) for i, l, s in zip(inputs, labels, drawn.tolist()) if s == 0]
    assert len(tiny) > 2 * per_pass  # the draw took the tiny source round more than twice
    for k in range(per_pass, len(tiny)):  # pass after pass, the same windows in the same order
        assert torch.equal(tiny[k], tiny[k - per_pass]), k
    state = json.loads(MixtureState(data).state_dict()["mixture"])
    assert state["names"] == ["tiny", "notes"] and state["windows"][0] == len(tiny)
    assert state["epochs"][0] == pytest.approx(len(tiny) / per_pass)
    assert state["epochs"][1] >= 2  # three short documents: every pass is read within a few windows
    restored = open_train_data(cfg.data, VOCAB, cfg.training.steps)
    MixtureState(restored).load_state_dict({"mixture": json.dumps(state)})
    assert restored.counts.totals()["windows"].tolist() == state["windows"]
    assert min(u.epoch for u in restored.streamed["notes"].plan.units) == state["epochs"][1]


def test_each_source_validates_on_its_own_data_and_the_mixture_by_the_stage_weights(tmp_path):
    pattern = shard(tmp_path)
    tables = [
        source("a", "synthetic", 3, seed=1),  # validates on a held-out seed
        source("b", "synthetic", 1, seed=2),
        source("web", "bin", 1, path=pattern, val_path=pattern),
        stage("late", 3, "b = 1, web = 1"),  # a leaves the mixture, and its mean
    ]
    extra = "\n[eval]\ninterval = 2\nval_batches = 1\n"
    (tmp_path / "mix.toml").write_text(config_text(4, *tables, extra=extra))
    train(load_config(["--config", str(tmp_path / "mix.toml"), "--job.dump_folder", str(tmp_path / "run")]))
    logged = rows(tmp_path / "run")
    for step, weights in ((2, {"a": 3, "b": 1, "web": 1}), (4, {"b": 1, "web": 1})):
        row = logged[step]
        losses = {n: row[f"val_loss/{n}"] for n in NAMES}
        assert len(set(losses.values())) == 3  # three held-out sets, three losses
        mean = sum(losses[n] * w for n, w in weights.items()) / sum(weights.values())
        assert row["val_loss"] == pytest.approx(mean, rel=1e-12), (step, row)
    assert "val_loss" not in logged[1] and "val_loss" not in logged[3]
