"""Verified checkpoints: the manifest in COMPLETE, verification before resume and the fallback past damaged
checkpoints, retention next to a damaged one, prompt async completion (poll), and load_step / load_path."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from distributed_utils import ROOT, TINY, losses, run_trainer
from helpers import SMALL
from torch import nn

import atma_titan.checkpoint.manager as checkpoint_module
from atma_titan.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointWarning,
    model_state,
    optimizer_state,
)
from atma_titan.checkpoint.manifest import files_on_disk, hash_file, read_marker
from atma_titan.run.folder import complete_steps
from atma_titan.utils.errors import InputError

# DCP's note that it runs in one process without torch.distributed: intended here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Job:
    """A model, AdamW and a train state; its per-rank state differs at every step."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.train_state = {"step": 0}

    def step(self) -> None:
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(self.train_state["step"]))
        self.model(x).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        self.train_state["step"] += 1

    def state(self) -> dict:
        return {"model": model_state(self.model), "optimizer": optimizer_state(self.model, self.opt),
                "train_state": self.train_state}  # fmt: skip

    def rank_state(self) -> dict:
        return {"step": self.train_state["step"], "rng": torch.full((4,), self.train_state["step"])}

    def params(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def saved_steps(folder: Path, steps, **manager) -> dict[int, dict]:
    """Save `steps` (one training step apart) under `folder`; the parameters at each."""
    job, params = Job(), {}
    ckpt = CheckpointManager(folder, **manager)
    for step in steps:
        while job.train_state["step"] < step:
            job.step()
        ckpt.save(step, job.state(), job.rank_state())
        params[step] = job.params()
    ckpt.close()
    return params


def assert_loaded(job: Job, state: dict, rank_state: dict, step: int, params: dict) -> None:
    assert state["train_state"]["step"] == step and rank_state["step"] == step
    assert torch.equal(rank_state["rng"], torch.full((4,), step))
    for k, v in job.params().items():
        assert torch.equal(v, params[step][k]), k


FILES = {"distcp": "__0_0.distcp", "metadata": ".metadata", "rank": "rank_state/rank-0.pt", "complete": "COMPLETE"}


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip":  # one bit in the middle: the subtlest change
        data = bytearray(data)
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()


# ---------------------------------------------------------------------------------------------
# The manifest


def test_complete_carries_a_manifest_of_every_file(tmp_path):
    saved_steps(tmp_path, [1])
    marker = read_marker(tmp_path / "step-1")
    on_disk = files_on_disk(tmp_path / "step-1")
    assert sorted(marker.files) == on_disk == [".metadata", "__0_0.distcp", "rank_state/rank-0.pt"]
    for name, entry in marker.files.items():
        assert entry == hash_file(tmp_path / "step-1" / name)
    raw = json.loads((tmp_path / "step-1" / "COMPLETE").read_text())
    assert raw["step"] == 1 and raw["world_size"] == 1 and raw["load_step"] == -1 and len(raw["xxh3_64"]) == 16


def test_hashing_throughput(tmp_path):
    """Records what verification costs: xxh3_64 in 8 MiB chunks, from the page cache."""
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(64 << 20))
    hash_file(path)  # warm
    began = time.perf_counter()
    hash_file(path)
    rate = (64 << 20) / (time.perf_counter() - began)
    print(f"xxh3_64: {rate / 1e9:.2f} GB/s; a 4.4 GB 370M checkpoint: {4.4e9 / rate:.2f} s on one rank")
    assert rate > 2e8  # far below what any machine does: this only guards against a pathological loop


# ---------------------------------------------------------------------------------------------
# Verification and fallback, in one process: every file kind x every kind of damage


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("kind", list(FILES))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one_exactly(tmp_path, kind, how):
    params = saved_steps(tmp_path, [1, 2])
    damage(tmp_path / "step-2" / FILES[kind], how)
    job = Job(seed=5)
    state = job.state()
    if kind == "complete" and how == "delete":  # no marker: an unfinished save, skipped without a word
        rank_state = CheckpointManager(tmp_path).load(state)
    else:
        with pytest.warns(CheckpointWarning) as warned:
            rank_state = CheckpointManager(tmp_path).load(state)
        message = str(warned[0].message)
        assert "step-2" in message and FILES[kind] in message, message
        assert "step-1" not in message
    assert_loaded(job, state, rank_state, 1, params)
    assert (tmp_path / "step-2").is_dir()  # a damaged checkpoint stays where it is


def test_every_problem_is_named(tmp_path):
    saved_steps(tmp_path, [1])
    ckpt = tmp_path / "step-1"
    (ckpt / "__9_0.distcp").write_bytes(b"x")  # a checkpoint file no save of this step wrote
    (ckpt / "notes.txt").write_text("a file of the user's: no part of the checkpoint, not a problem")
    damage(ckpt / "__0_0.distcp", "truncate")
    (ckpt / "rank_state" / "rank-0.pt").unlink()
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as raised:
        CheckpointManager(tmp_path).load(Job().state())
    message = str(raised.value)
    assert isinstance(raised.value, InputError) and f"no checkpoint under {tmp_path} verifies" in message
    assert "__0_0.distcp: " in message and "(truncated)" in message
    assert "rank_state/rank-0.pt: missing" in message
    assert "__9_0.distcp: present, but not in the manifest" in message and "notes.txt" not in message


def test_none_verifying_lists_what_was_tried(tmp_path):
    saved_steps(tmp_path, [1, 2])
    damage(tmp_path / "step-2" / ".metadata", "flip")
    damage(tmp_path / "step-1" / "COMPLETE", "truncate")
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as raised:
        CheckpointManager(tmp_path).load(Job().state())
    message = str(raised.value)
    assert "tried step-2: .metadata: xxh3_64" in message and "| step-1: COMPLETE: COMPLETE is not valid JSON" in message


def legacy(ckpt: Path) -> None:
    """Rewrite COMPLETE as checkpoints had it before manifests."""
    (ckpt / "COMPLETE").write_text(json.dumps({"step": 1, "world_size": 1, "time": 0.0, "torch": "2.11"}))


def test_checkpoint_without_manifest_loads_unverified(tmp_path):
    params = saved_steps(tmp_path, [1])
    legacy(tmp_path / "step-1")
    job = Job(seed=3)
    state = job.state()
    with pytest.warns(CheckpointWarning, match="no manifest"):
        rank_state = CheckpointManager(tmp_path).load(state)
    assert_loaded(job, state, rank_state, 1, params)


def test_failure_inside_dcp_load_is_an_input_error_naming_the_step(tmp_path):
    """Damage no manifest can see (there is none) becomes a CheckpointError naming the step, not a traceback."""
    saved_steps(tmp_path, [1])
    legacy(tmp_path / "step-1")
    data = tmp_path / "step-1" / "__0_0.distcp"
    data.write_bytes(b"\0" * data.stat().st_size)  # the same size: only dcp.load can tell
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as raised:
        CheckpointManager(tmp_path).load(Job().state())
    message = str(raised.value)
    assert f"loading checkpoint {tmp_path / 'step-1'} failed (it has no manifest" in message
    assert "rank 0: __0_0.distcp: " in message and "\n" not in message

    truncated = tmp_path / "trunc"
    saved_steps(truncated, [1])
    legacy(truncated / "step-1")
    damage(truncated / "step-1" / "__0_0.distcp", "truncate")  # the .metadata says how long it must be
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="references .* bytes of __0_0.distcp"):
        CheckpointManager(truncated).load(Job().state())


# ---------------------------------------------------------------------------------------------
# Retention next to a damaged checkpoint


def test_retention_never_lets_a_damaged_newer_checkpoint_push_out_the_fallback(tmp_path):
    params = saved_steps(tmp_path, [1, 3], keep_latest_k=2)
    damage(tmp_path / "step-3" / "__0_0.distcp", "flip")
    job = Job(seed=4)
    ckpt = CheckpointManager(tmp_path, keep_latest_k=2)
    with pytest.warns(CheckpointWarning):
        assert_loaded(job, (state := job.state()), ckpt.load(state), 1, params)
    job.step()
    ckpt.save(2, job.state(), job.rank_state())
    # The two newest good ones stay; the damaged newer one is left alone and does not count.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2", "step-3"]
    with pytest.warns(CheckpointWarning, match="step-3"):
        assert ckpt.load(job.state())["step"] == 2


# ---------------------------------------------------------------------------------------------
# Async saves complete at the first poll after the write


def test_async_complete_appears_at_the_first_poll_after_the_write(tmp_path, monkeypatch):
    gate = threading.Event()
    hash_files = checkpoint_module._hash_files

    def slow_hash(*args):  # the background write (and its hashing) takes as long as the test says
        if threading.current_thread().name.startswith("checkpoint-hash"):
            assert gate.wait(30)
        return hash_files(*args)

    monkeypatch.setattr(checkpoint_module, "_hash_files", slow_hash)
    job, saved = Job(), []
    ckpt = CheckpointManager(tmp_path, async_save=True, on_saved=lambda step, path, s: saved.append(step))
    ckpt.save(1, job.state(), job.rank_state())
    for _ in range(3):  # steps go on while it writes
        job.step()
        assert not ckpt.poll() and not (tmp_path / "step-1" / "COMPLETE").exists()
    gate.set()
    deadline = time.monotonic() + 30
    while not ckpt._pending.hashed.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ckpt.poll()  # the very next step's poll completes it: marker, manifest, on_saved
    assert saved == [1] and read_marker(tmp_path / "step-1").files
    assert not ckpt.poll()  # nothing in flight: no collective, nothing to do
    ckpt.close()


ASYNC_RANKS = textwrap.dedent("""
    import json, sys, threading, time
    import torch, torch.distributed as dist
    from torch import nn
    import atma_titan.checkpoint.manager as cm

    dist.init_process_group("gloo")
    rank, folder = dist.get_rank(), sys.argv[1]
    real = cm._hash_files
    def slow_on_rank_1(*args):
        if rank == 1 and threading.current_thread().name.startswith("checkpoint-hash"):
            time.sleep(1.0)
        return real(*args)
    cm._hash_files = slow_on_rank_1
    model = nn.Linear(4, 4)
    ckpt = cm.CheckpointManager(folder, async_save=True)
    ckpt.save(1, {"model": cm.model_state(model)}, {"rank": rank})
    polls = 0
    while not ckpt.poll():  # one poll per "training step"; rank 0's write is long done
        polls += 1
        time.sleep(0.02)
        assert polls < 1000
    complete = (ckpt.checkpoint_dir(1) / "COMPLETE").is_file()
    with open(f"{folder}/polls-{rank}.json", "w") as f:
        json.dump({"polls": polls, "complete": complete}, f)
    ckpt.close()
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_async_poll_is_collective_ranks_finish_together(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(ASYNC_RANKS)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    polls = [json.loads((tmp_path / f"polls-{r}.json").read_text()) for r in (0, 1)]
    assert polls[0] == polls[1] and polls[0]["complete"], polls  # the same poll finished it on both ranks
    assert polls[0]["polls"] >= 10  # rank 0 waited for rank 1's slower write
    assert sorted(read_marker(tmp_path / "step-1").files) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "rank_state/rank-0.pt", "rank_state/rank-1.pt",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# load_step: a rollback, then a requeue that continues from the run's own newer checkpoints


def test_load_step_rolls_back_and_a_requeue_continues_from_its_own_newer_checkpoints(tmp_path):
    params = saved_steps(tmp_path, [2, 4, 6])
    job = Job(seed=1)
    rollback = CheckpointManager(tmp_path, load_step=4)
    with pytest.warns(CheckpointWarning, match="moved the newer checkpoints step-6"):
        assert_loaded(job, (state := job.state()), rollback.load(state, step=4), 4, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rolled_back", "step-2", "step-4"]
    assert [p.name for p in (tmp_path / "rolled_back").glob("*/*")] == ["step-6"]  # kept, out of the way
    job.step()
    rollback.save(5, job.state(), job.rank_state())
    assert read_marker(tmp_path / "step-5").load_step == 4

    requeued = Job(seed=2)  # the same command again (a requeue): its own newer step 5, not a second rollback
    state = requeued.state()
    assert CheckpointManager(tmp_path, load_step=4).load(state, step=4)["step"] == 5
    assert (tmp_path / "step-5").is_dir() and state["train_state"]["step"] == 5

    with pytest.raises(CheckpointNotFoundError) as raised:
        CheckpointManager(tmp_path, load_step=7).load(Job().state(), step=7)
    assert str(raised.value) == (
        f"checkpoint {tmp_path / 'step-7'} does not exist; "
        f"complete checkpoints under {tmp_path}: step-2, step-4, step-5"
    )


# ---------------------------------------------------------------------------------------------
# The trainer: 2 ranks skip two damaged checkpoints; load_step / load_path errors exit 2


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def set_manifest_entry(ckpt: Path, name: str) -> None:
    """Make COMPLETE describe `name` as it is now (what someone crafting a checkpoint would do)."""
    from atma_titan.checkpoint.manifest import read_marker, write_marker

    marker = read_marker(ckpt)
    raw = json.loads((ckpt / "COMPLETE").read_text())
    info = {k: raw[k] for k in ("step", "world_size", "time", "torch", "load_step")}
    write_marker(ckpt, info, {**marker.files, name: hash_file(ckpt / name)})


@pytest.mark.slow
def test_two_ranks_skip_damaged_checkpoints_and_train_as_a_straight_run(tmp_path):
    common = [*TINY, "--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
              "--checkpoint.async_save", "true", "--data.num_workers", "1"]  # fmt: skip
    straight = tmp_path / "straight"
    ok(run_trainer(2, *common, "--job.dump_folder", str(straight)))
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    (resumed / "DONE").unlink()
    ckpts = resumed / "checkpoints"
    # step-6: a truncated shard, in rank 1's share of the files; step-4: a rank file that would run a
    # command when unpickled, with a manifest that matches it (so only the safe loading stops it).
    damage(ckpts / "step-6" / "__0_0.distcp", "truncate")
    marker = tmp_path / "pwned"
    evil = f"import os, torch\nclass E:\n    def __reduce__(self): return (os.system, ('touch {marker}',))\n"
    evil += f"torch.save({{'loader': E()}}, {str(ckpts / 'step-4' / 'rank_state' / 'rank-0.pt')!r})\n"
    subprocess.run([sys.executable, "-c", evil], check=True)
    set_manifest_entry(ckpts / "step-4", "rank_state/rank-0.pt")

    proc = ok(run_trainer(2, *common, "--job.dump_folder", str(resumed)))
    assert f"resumed from {ckpts / 'step-2'} at step 2" in proc.stdout
    assert f"checkpoint {ckpts / 'step-6'} is damaged and is skipped: __0_0.distcp: " in proc.stderr
    assert "(truncated)" in proc.stderr
    assert f"checkpoint {ckpts / 'step-4'} is damaged and is skipped: rank_state/rank-0.pt: " in proc.stderr
    assert "GLOBAL posix.system" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()
    a, b = losses(straight), losses(resumed)
    assert [b[s] for s in range(3, 7)] == [a[s] for s in range(3, 7)]  # bit-identical


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A 1-process run with checkpoints at steps 1 and 2."""
    from atma_titan.config import load_config
    from atma_titan.train import train

    folder = tmp_path_factory.mktemp("small") / "run"
    args = ["--config", "train_configs/debug_model.toml", *SMALL, "--training.steps", "2", "--metrics.stdout",
            "false", "--checkpoint.enable", "true", "--checkpoint.interval", "1"]  # fmt: skip
    train(load_config([*args, "--job.dump_folder", str(folder)]))
    return folder, args


def main_exit(args: list[str], capsys) -> tuple[int, str]:
    from atma_titan.train import main

    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("load_step", "7", "checkpoint.load_step = 7: checkpoint {ck}/step-7 does not exist; complete checkpoints "
         "under {ck}: step-1, step-2"),
        ("load_path", "/nonexistent", "checkpoint.load_path = '/nonexistent': checkpoint /nonexistent does not exist"),
        ("load_path", "{ck}/step-9", "checkpoint {ck}/step-9 does not exist; complete checkpoints under {ck}: "
         "step-1, step-2"),
    ],
)  # fmt: skip
def test_load_step_and_load_path_that_name_nothing_exit_2(small_run, tmp_path, capsys, flag, value, message):
    folder, args = small_run
    ck = folder / "checkpoints"
    dump = folder if flag == "load_step" else tmp_path / "new"
    more = ["--training.steps", "3", f"--checkpoint.{flag}", value.format(ck=ck)]  # more steps: not finished
    code, err = main_exit([*args, "--job.dump_folder", str(dump), *more], capsys)
    assert code == 2 and message.format(ck=ck) in err, err


def test_no_checkpoint_that_verifies_exits_2(small_run, tmp_path, capsys):
    folder, args = small_run
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    for step in (1, 2):
        damage(copy / "checkpoints" / f"step-{step}" / "__0_0.distcp", "flip")
    code, err = main_exit([*args, "--job.dump_folder", str(copy), "--training.steps", "3"], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"error: no checkpoint under {copy / 'checkpoints'} verifies; tried step-2: __0_0.distcp: xxh3_64" in err
    assert f"warning: checkpoint {copy / 'checkpoints' / 'step-2'} is damaged and is skipped" in err


def test_a_resume_sets_a_damaged_checkpoint_aside_and_never_overwrites_it(small_run, tmp_path, capsys):
    folder, args = small_run
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    ckpts = copy / "checkpoints"
    damage(ckpts / "step-2" / "__0_0.distcp", "flip")
    damaged = {p.name: p.read_bytes() for p in (ckpts / "step-2").rglob("*") if p.is_file()}
    code, err = main_exit([*args, "--job.dump_folder", str(copy), "--training.steps", "3"], capsys)
    assert code == 0, err
    aside = ckpts / "step-2.damaged"
    assert f"moved the damaged checkpoint step-2 aside to {aside} (kept, not deleted)" in err
    assert {p.name: p.read_bytes() for p in aside.rglob("*") if p.is_file()} == damaged  # as it was
    assert complete_steps(ckpts) == [1, 2, 3]  # step 2 trained again and saved in a directory of its own
    # A second damaged step-2 goes beside the first, which stays.
    (copy / "DONE").unlink()
    damage(ckpts / "step-3" / "__0_0.distcp", "flip")
    damage(ckpts / "step-2" / "__0_0.distcp", "flip")
    code, err = main_exit([*args, "--job.dump_folder", str(copy), "--training.steps", "3"], capsys)
    assert code == 0, err
    assert (ckpts / "step-2.damaged-2").is_dir() and (ckpts / "step-3.damaged").is_dir()
    assert {p.name: p.read_bytes() for p in aside.rglob("*") if p.is_file()} == damaged


@pytest.mark.slow
def test_trainer_load_step_rollback_then_requeue(small_run, tmp_path, capsys):
    from atma_titan.config import load_config
    from atma_titan.train import train

    folder, args = small_run
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    rollback = [*args, "--job.dump_folder", str(copy), "--checkpoint.load_step", "1", "--training.steps", "3"]
    train(load_config(rollback))  # back to step 1, then steps 2 and 3 again
    assert [p.name for p in (copy / "checkpoints" / "rolled_back").glob("*/*")] == ["step-2"]
    assert read_marker(copy / "checkpoints" / "step-3").load_step == 1
    capsys.readouterr()
    train(load_config([*rollback, "--training.steps", "4"]))  # continued later: from its own step 3, not 1
    out = capsys.readouterr().out
    assert f"resumed from {copy / 'checkpoints' / 'step-3'} at step 3" in out
    assert (copy / "DONE").read_text().split() == ["4"]
