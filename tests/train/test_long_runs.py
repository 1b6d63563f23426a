"""Long runs (docs/training.md): the bad-batch record holds what the bad step trained on, data.skip /
data.skip_windows leave exactly those windows out (one source, a mixture, across a resume at another world size),
and a resume may change the skipped data ahead of its position only. The spike policies are in
tests/run/test_spikes.py, the skip arithmetic in tests/data/test_skips.py.

The runs record every micro-batch their loop takes (tests/support/record_batches.py): in this process for one
rank, under torchrun for two."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import atma_titan.train as trainer
from atma_titan.config import load_config
from atma_titan.data.build import build_source
from atma_titan.models import resolve_model_args
from distributed_utils import ROOT, TINY
from mixture_tables import two_sources
from record_batches import recording

pytestmark = pytest.mark.slow

G, MICRO, SEQ = 8, 2, 32  # TINY: 8 windows of 32 a step, micro-batches of 2
_AT = TINY.index("--job.deterministic")  # in this process: torch's deterministic mode (process-wide) left off
LOCAL = [str(ROOT / a) if a.endswith(".toml") else a for a in TINY[:_AT] + TINY[_AT + 2 :]]
OPEN_LOADER = trainer.open_loader


def train_here(record: Path | None, *args: str) -> int:
    """The trainer in this process (one rank), recording its micro-batches into `record`; its exit status."""
    trainer.open_loader = recording(OPEN_LOADER, record) if record else OPEN_LOADER
    try:
        return trainer.main(list(args))
    finally:
        trainer.open_loader = OPEN_LOADER


def train_torchrun(nproc: int, record: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(ROOT / "tests" / "support" / "record_batches.py"), str(record), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def micro_batches(record: Path, rank: int = 0) -> list[np.ndarray]:
    """The rank's micro-batches in the order its loop took them: (rows, seq_len + 1) each."""
    return [np.asarray(json.loads(line)) for line in (record / f"rank-{rank}.jsonl").read_text().splitlines()]


def steps(record: Path, world: int = 1, first_step: int = 1) -> dict[int, np.ndarray]:
    """Each step's global batch, (G, seq_len + 1): the ranks' slices in rank order."""
    per_step = G // world // MICRO
    ranks = [micro_batches(record, r) for r in range(world)]
    count = len(ranks[0]) // per_step
    return {
        first_step + s: np.concatenate([np.concatenate(b[s * per_step : (s + 1) * per_step]) for b in ranks])
        for s in range(count)
    }  # fmt: skip


def source_windows(indices) -> np.ndarray:
    """The windows of TINY's synthetic source (debug_model.toml's data) by global stream index."""
    cfg = load_config(LOCAL)
    source = build_source(cfg.data, resolve_model_args(cfg.model).vocab_size)
    return np.stack([source.window(int(i), SEQ + 1) for i in indices])


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` but metrics.jsonl, by relative path, with its bytes."""
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "metrics.jsonl")
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


def metrics_rows(folder: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


# ---------------------------------------------------------------------------------------------
# The bad-batch record


def test_the_bad_batch_record_holds_the_windows_the_step_trained_on(tmp_path):
    """2 ranks: a spike at step 5 (policy log) and a NaN at step 6 (skipped); records = 1 keeps the first alone.
    Each rank's npz holds exactly the micro-batches its loop took at step 5, and their global window indices."""
    args = [*TINY, "--training.steps", "6", "--job.dump_folder", str(tmp_path / "run"), "--spikes.warmup", "3"]
    args += ["--debug.spike_at_step", "5", "--debug.nan_at_step", "6", "--training.nan_policy", "skip"]
    proc = train_torchrun(2, tmp_path / "rec", *args, "--spikes.records", "1")
    assert "step 5 spiked" in proc.stdout and "step 6: loss nan" in proc.stdout
    assert (tmp_path / "run" / "DONE").exists()
    folders = sorted(p.name for p in (tmp_path / "run" / "bad_batches").iterdir())
    assert folders == ["step-000005"]  # two bad steps, one record
    record = tmp_path / "run" / "bad_batches" / "step-000005"
    assert sorted(p.name for p in record.iterdir()) == ["rank-00000.npz", "rank-00001.npz", "summary.json"]
    per_rank, accum = G // 2, G // 2 // MICRO
    shares = []
    for rank in range(2):
        saved = np.load(record / f"rank-{rank:05d}.npz")
        taken = micro_batches(tmp_path / "rec", rank)[4 * accum : 5 * accum]  # step 5's micro-batches
        assert saved["tokens"].dtype == np.int32 and saved["tokens"].shape == (per_rank, SEQ + 1)
        assert np.array_equal(saved["tokens"], np.concatenate(taken))
        assert saved["micro_batch"].tolist() == [m for m in range(accum) for _ in range(MICRO)]
        windows = 4 * G + rank * per_rank + np.arange(per_rank)
        assert saved["windows"].tolist() == windows.tolist()
        assert np.array_equal(saved["tokens"], source_windows(windows))  # the source's windows at those indices
        assert saved["sources"].tolist() == [-1] * per_rank
        assert saved["losses"].shape == (accum,) and np.isfinite(saved["losses"]).all()
        shares += saved["losses"].tolist()
    summary = json.loads((record / "summary.json").read_text())
    logged = metrics_rows(tmp_path / "run")[5]
    assert summary["step"] == 5 and summary["reason"] == "spike"
    assert summary["loss"] == pytest.approx(logged["loss"], rel=1e-6)
    assert sum(shares) == pytest.approx(logged["loss"], rel=1e-5)  # each micro-batch's share of the step's loss
    assert summary["grad_norm"] == pytest.approx(logged["grad_norm"], rel=1e-6)
    assert summary["spike"]["step"] == 5 and summary["spike"]["loss_z"] == pytest.approx(logged["spike_loss_z"])
    layout = dict(ranks=2, micro_batches_per_rank=accum, micro_batch=MICRO, seq_len=SEQ, windows_before=4 * G)
    assert summary["layout"] == layout
    norms = summary["largest_gradient_norms"]
    assert len(norms) == 20 and all(isinstance(n, str) and "." in n for n, _ in norms)  # parameter names
    assert [v for _, v in norms] == sorted((v for _, v in norms), reverse=True)
    # Before the clip (max_norm 1 scales this step's gradients by ~1/80): the x 50 spike's norm lies in the head,
    # so the 20 largest hold nearly all of the global norm.
    top = np.sqrt(sum(v * v for _, v in norms))
    assert 0.9 * summary["grad_norm"] < top <= summary["grad_norm"] * (1 + 1e-4)
    assert "data.skip = [[5, 5]]" in summary["roll_back"]


# ---------------------------------------------------------------------------------------------
# data.skip and data.skip_windows


MIXTURE = f"""
[job]
seed = 0
print_config = false

[model]
flavor = "debug"

[training]
seq_len = {SEQ}
batch_tokens = {SEQ * G}
micro_batch_size = {MICRO}
device = "cpu"

[metrics]
log_freq = 1

[checkpoint]
enable = true
interval = 100

[data]
tokenizer = "byte"
seed = 7
""" + two_sources(late_step=4)


def data_args(kind: str, tmp_path: Path) -> list[str]:
    if kind == "synthetic":
        return LOCAL
    (tmp_path / "mix.toml").write_text(MIXTURE)
    return ["--config", str(tmp_path / "mix.toml")]


@pytest.mark.parametrize("kind", ["synthetic", "mixture"])
def test_data_skip_trains_the_straight_run_without_the_skipped_steps_at_any_world_size(tmp_path, kind, capsys):
    """data.skip = [[3, 4]]: a 4-step run trains a 6-step straight run's steps 1, 2, 5, 6 (a mixture's stage,
    from stream step 4, included); saved on 2 ranks after step 3 and resumed on 1, the same."""
    common = data_args(kind, tmp_path)
    assert train_here(tmp_path / "rec-straight", *common, "--training.steps", "6", "--job.dump_folder",
                      str(tmp_path / "straight")) == 0  # fmt: skip
    skip = [*common, "--training.steps", "4", "--data.skip", "[[3, 4]]"]
    assert train_here(tmp_path / "rec-skip", *skip, "--job.dump_folder", str(tmp_path / "skip")) == 0
    straight, skipped = steps(tmp_path / "rec-straight"), steps(tmp_path / "rec-skip")
    assert list(straight) == list(range(1, 7)) and list(skipped) == [1, 2, 3, 4]
    for step, stream_step in ((1, 1), (2, 2), (3, 5), (4, 6)):
        assert np.array_equal(skipped[step], straight[stream_step]), step
    assert list(metrics_rows(tmp_path / "skip")) == [1, 2, 3, 4]
    if kind == "synthetic":  # the stream's own windows, by index
        assert np.array_equal(skipped[3], source_windows(range(4 * G, 5 * G)))

    # Saved on 2 ranks (SIGTERM in step 3), resumed on 1: every step's windows are the 1-rank skip run's.
    moved = ["--job.dump_folder", str(tmp_path / "moved")]
    first = [*skip, *moved, "--debug.signal_at_step", "3"]
    proc = train_torchrun(2, tmp_path / "rec-2", *first)
    assert "received SIGTERM" in proc.stderr and "step 3: leaving out the data of stream steps 3..4" in proc.stdout
    capsys.readouterr()
    assert train_here(tmp_path / "rec-1", *skip, *moved) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 3" in out and "leaving out the data of steps 3..4 (data.skip)" in out
    assert list(metrics_rows(tmp_path / "moved")) == [1, 2, 3, 4]
    before, after = steps(tmp_path / "rec-2", world=2), steps(tmp_path / "rec-1", first_step=4)
    assert list(before) == [1, 2, 3] and list(after) == [4]
    for step, windows in {**before, **after}.items():
        assert np.array_equal(windows, skipped[step]), step


def test_data_skip_windows_leaves_out_exactly_those_windows(tmp_path, capsys):
    """Windows 10..12 (part of step 2): step 2 trains windows 8, 9, 13..18, step 3 windows 19..26."""
    args = [*LOCAL, "--training.steps", "3", "--data.skip_windows", "10,12", "--job.dump_folder", str(tmp_path / "r")]
    assert train_here(tmp_path / "rec", *args) == 0
    assert "leaving out the data of windows 10..12 (data.skip)" in capsys.readouterr().out
    trained = np.concatenate(list(steps(tmp_path / "rec").values()))
    assert np.array_equal(trained, source_windows([*range(10), *range(13, 27)]))


# ---------------------------------------------------------------------------------------------
# Resuming with other skips


def test_a_resume_may_skip_data_ahead_of_its_position_but_not_behind_it(tmp_path, capsys):
    run = ["--job.dump_folder", str(tmp_path / "run")]
    assert train_here(None, *LOCAL, *run, "--training.steps", "3") == 0  # its checkpoint: step 3, 24 windows in
    capsys.readouterr()
    before = snapshot(tmp_path / "run")
    for behind in ("[[2, 2]]", "[[3, 4]]"):  # before the position, and straddling it
        status = train_here(None, *LOCAL, *run, "--training.steps", "5", "--data.skip", behind)
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert status == 2 and len(errors) == 1, errors
        assert "data.skip" in errors[0] and "before the checkpoint's position" in errors[0], errors[0]
        # config.toml, DONE and the checkpoints untouched; metrics.jsonl keeps its rows (the logger, opened before the
        # checkpoint is loaded, has appended a "resume" event line: no step row)
        assert snapshot(tmp_path / "run") == before
        assert list(metrics_rows(tmp_path / "run")) == [1, 2, 3]

    # Ahead: stream step 5 left out, so step 4 trains stream step 4 and step 5 stream step 6. Step 5 spikes too
    # (judged by the checkpoint's window of 3 steps): its record and rollback count in the stream's numbering, and the
    # rollback keeps the range in force (a new data.skip replaces the old).
    ahead = ["--training.steps", "5", "--data.skip", "[[5, 5]]", "--spikes.warmup", "3", "--debug.spike_at_step", "5"]
    assert train_here(tmp_path / "rec", *LOCAL, *run, *ahead) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 3" in out and "data.skip saved [], requested [5, 5]" in out, out
    trained = steps(tmp_path / "rec", first_step=4)
    assert np.array_equal(trained[4], source_windows(range(3 * G, 4 * G)))
    assert np.array_equal(trained[5], source_windows(range(5 * G, 6 * G)))
    assert list(metrics_rows(tmp_path / "run")) == [1, 2, 3, 4, 5]
    record = tmp_path / "run" / "bad_batches" / "step-000005"
    assert np.load(record / "rank-00000.npz")["windows"].tolist() == list(range(5 * G, 6 * G))
    summary = json.loads((record / "summary.json").read_text())
    assert summary["step"] == 5 and summary["roll_back"].endswith("data.skip = [[5, 5], [6, 6]]")


def test_data_skip_drops_a_streamed_text_sources_skipped_steps(tmp_path, monkeypatch, capsys):
    """A text source has no global window index: its skipped steps' micro-batches are read and dropped, so the run
    trains, after the skipped steps, what the straight run trained after them (the model's own inputs compared)."""
    from atma_titan.models.atma import ATMA

    with open(tmp_path / "docs.jsonl", "w") as out:
        for d in range(60):
            out.write(json.dumps({"text": f"document {d} " + "word " * (d % 7 + 3)}) + "\n")
    trained, forward = [], ATMA.forward

    def spy(self, tokens, *args, **kwargs):
        if self.training:
            trained.append(tokens.clone())
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(ATMA, "forward", spy)
    text = ["--data.source", "text", "--data.path", str(tmp_path / "docs.jsonl"), "--checkpoint.enable", "false"]
    assert train_here(None, *LOCAL, *text, "--training.steps", "6", "--job.dump_folder", str(tmp_path / "a")) == 0
    straight, trained[:] = list(trained), []
    skip = ["--data.skip", "[[3, 4]]", "--job.dump_folder", str(tmp_path / "b")]
    assert train_here(None, *LOCAL, *text, "--training.steps", "4", *skip) == 0
    per_step = G // MICRO
    assert len(straight) == 6 * per_step and len(trained) == 4 * per_step
    kept = straight[: 2 * per_step] + straight[4 * per_step :]  # steps 1-2, then 5-6
    assert all(a.equal(b) for a, b in zip(trained, kept))
    assert "leaving out the data of stream steps 3..4" in capsys.readouterr().out
