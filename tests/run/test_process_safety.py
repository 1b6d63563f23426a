"""Ctrl-C is a graceful stop; trainers stop when torchrun dies; one job per run folder (LOCK)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from atma_titan.run import lock as folder_lock
from atma_titan.run.lock import FolderLock, FolderLocked
from distributed_utils import ROOT, TINY, losses, run_trainer

# ---------------------------------------------------------------------------------------------
# The stop handler: SIGINT, duplicates, forked children


def run_child(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
        import os, signal, time
        from atma_titan.run.preemption import StopRequest
        stop = StopRequest(abort_after_s=0.2).install()
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_sigint_requests_a_stop_and_a_forwarded_duplicate_is_not_an_abort():
    # Ctrl-C in a terminal, then the same stop forwarded by a launcher a moment later.
    proc = run_child("""
        os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.05)
        print(stop.requested, stop.received)
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "True SIGINT", proc.stderr
    assert "received SIGINT: finishing this step" in proc.stderr and "aborting" not in proc.stderr


def test_a_second_ctrl_c_later_aborts_at_once():
    proc = run_child("""
        os.kill(os.getpid(), signal.SIGINT); time.sleep(0.3); os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5); print('alive')
    """)
    assert proc.returncode == 128 + signal.SIGINT and "alive" not in proc.stdout
    assert "received SIGINT again: aborting now" in proc.stderr


def test_a_forked_child_keeps_running_on_the_stop_signal():
    """A DataLoader worker gets the terminal's SIGINT too; it must live on to serve the last step."""
    proc = run_child("""
        pid = os.fork()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGINT); time.sleep(0.1)
            print('child', stop.requested, flush=True); os._exit(0)
        _, status = os.waitpid(pid, 0)
        print('parent', stop.requested, os.waitstatus_to_exitcode(status))
    """)
    assert proc.stdout.split("\n")[:2] == ["child False", "parent False 0"], proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# The launcher watch: a stand-in launcher (parent) of a trainer-like child, killed with SIGKILL

LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""

CHILD = """
import os, time
from atma_titan.run import preemption
if os.environ.get("NO_PDEATHSIG"):
    preemption.set_parent_death_signal = lambda sig: False  # the portable per-step check alone
from atma_titan.run.preemption import LauncherWatch, StopRequest
stop = StopRequest(launcher=LauncherWatch.start()).install()
out = os.environ["RESULT"]
open(out + ".ready", "w").close()
for _ in range(40):  # the "training loop"
    stop.check_launcher()
    if stop.requested:
        break
    time.sleep(0.05)
open(out + ".tmp", "w").write(str(stop.received))
os.replace(out + ".tmp", out)  # whole: the test reads it the moment it exists
"""


def launch_and_kill_the_launcher(tmp_path: Path, env: dict) -> str:
    """What stopped the child's loop once its launcher was killed ("None": nothing, it ran to its end)."""
    result = tmp_path / "result"
    env = {**env, "RESULT": str(result)}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, CHILD], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    launcher.stdout.readline()  # the child's pid: it is started
    deadline = time.time() + 30
    while not Path(f"{result}.ready").exists() and time.time() < deadline:
        time.sleep(0.02)
    launcher.kill()
    launcher.wait()
    while not result.exists() and time.time() < deadline:
        time.sleep(0.02)
    return result.read_text()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return ""


def without_torchrun() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl")
def test_under_torchrun_the_death_of_the_launcher_is_a_stop_request(tmp_path):
    # PR_SET_PDEATHSIG: the kernel sends SIGTERM the moment the launcher dies.
    assert launch_and_kill_the_launcher(tmp_path, {**without_torchrun(), "TORCHELASTIC_RUN_ID": "t"}) == "SIGTERM"


def test_without_the_death_signal_the_per_step_parent_check_stops_it(tmp_path):
    env = {**without_torchrun(), "TORCHELASTIC_RUN_ID": "t", "NO_PDEATHSIG": "1"}
    assert launch_and_kill_the_launcher(tmp_path, env) == "launcher exited"


def test_a_plain_python_run_outlives_its_shell(tmp_path):
    assert launch_and_kill_the_launcher(tmp_path, without_torchrun()) == "None"


# ---------------------------------------------------------------------------------------------
# The folder lock


def plant_lock(folder: Path, **fields) -> Path:
    """A LOCK as another job would have written it (this host unless `host` is given)."""
    folder.mkdir(parents=True, exist_ok=True)
    content = {**folder_lock.this_process(), **fields}
    if "pid" in fields and "pid_start" not in fields:
        content["pid_start"] = folder_lock._process_start(fields["pid"])
    path = folder / folder_lock.LOCK_NAME
    path.write_text(json.dumps(content))
    return path


@pytest.fixture
def live_pid():
    sleeper = subprocess.Popen(["sleep", "60"])
    yield sleeper.pid
    sleeper.kill()
    sleeper.wait()


@pytest.fixture
def dead_pid():
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_the_lock_names_its_holder_and_is_removed_on_release(tmp_path):
    lock = FolderLock.acquire(tmp_path / "run")
    held = json.loads((tmp_path / "run" / "LOCK").read_text())
    assert held["host"] == socket.gethostname() and held["pid"] == os.getpid() and held["heartbeat"] > 0
    with pytest.raises(FolderLocked, match=rf"in use by another training job: host \S+, pid {os.getpid()}"):
        FolderLock.acquire(tmp_path / "run")
    lock.release()
    assert not (tmp_path / "run" / "LOCK").exists()


def test_a_live_holder_keeps_the_folder(tmp_path, live_pid, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1001")
    plant_lock(tmp_path, pid=live_pid, slurm_job_id="777")
    with pytest.raises(FolderLocked) as refused:
        FolderLock.acquire(tmp_path)
    message = str(refused.value)
    assert f"pid {live_pid}, SLURM job 777" in message and "last heartbeat 0 s ago" in message
    assert f"delete {tmp_path}/LOCK" in message


@pytest.mark.parametrize(
    "why, fields",
    [
        ("is no longer running", {"pid": "dead"}),
        ("is no longer running", {"pid": os.getpid(), "pid_start": "1"}),  # a reused pid
        ("heartbeat is", {"host": "elsewhere", "heartbeat": time.time() - folder_lock.STALE_AFTER_S - 5}),
        ("this same SLURM job", {"host": "elsewhere", "slurm_job_id": "4242"}),
    ],
)
def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, dead_pid, monkeypatch, capsys, why, fields):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    if fields.get("pid") == "dead":
        fields = {**fields, "pid": dead_pid}
    plant_lock(tmp_path, **fields)
    lock = FolderLock.acquire(tmp_path)
    err = capsys.readouterr().err
    assert "warning: taking over the stale lock" in err and why in err, err
    assert json.loads((tmp_path / "LOCK").read_text())["token"] == lock.content["token"]
    lock.release()


def test_a_fresh_lock_of_another_host_and_job_is_held(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "2")
    plant_lock(tmp_path, host="elsewhere", pid=1, slurm_job_id="1", heartbeat=time.time() - 60)
    with pytest.raises(FolderLocked, match="host elsewhere, pid 1, SLURM job 1 .*last heartbeat 60 s ago"):
        FolderLock.acquire(tmp_path)


def test_the_heartbeat_refreshes_and_a_foreign_lock_is_never_removed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(folder_lock, "HEARTBEAT_S", 0.05)
    lock = FolderLock.acquire(tmp_path)
    first = lock.content["heartbeat"]
    deadline = time.time() + 10
    while json.loads((tmp_path / "LOCK").read_text())["heartbeat"] == first and time.time() < deadline:
        time.sleep(0.02)
    assert json.loads((tmp_path / "LOCK").read_text())["heartbeat"] > first
    plant_lock(tmp_path, host="elsewhere", token="theirs")  # taken over behind this job's back
    time.sleep(0.3)
    lock.release()
    assert json.loads((tmp_path / "LOCK").read_text())["token"] == "theirs"
    assert "is no longer this job's (now held by host elsewhere" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Real runs


def trainer_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def wait_for_rows(folder: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    metrics, deadline = folder / "metrics.jsonl", time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be interrupted"
        time.sleep(0.05)


def saved_steps(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (folder / "checkpoints").iterdir() if (p / "COMPLETE").exists())


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_the_run_resumes_exactly(tmp_path, dead_pid):
    common = [*TINY, "--training.steps", "1000", "--checkpoint.enable", "true", "--checkpoint.interval", "1000"]
    common += ["--data.num_workers", "1"]
    folder = tmp_path / "interrupted"
    # As a terminal does on Ctrl-C: SIGINT to the whole process group (trainer and loader worker).
    proc = subprocess.Popen(
        [sys.executable, "-m", "atma_titan.train", *common, "--job.dump_folder", str(folder)],
        cwd=ROOT, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    wait_for_rows(folder, 3, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    [step] = saved_steps(folder)
    assert f"stopped at step {step} on request (SIGINT): checkpoint step {step} saved" in out
    assert "KeyboardInterrupt" not in err and not (folder / "LOCK").exists() and not (folder / "DONE").exists()

    plant_lock(folder, pid=dead_pid)  # as a killed run leaves it: taken over on this host at once
    stop_at = ["--debug.signal_at_step", str(step + 3)]
    resumed = run_trainer(1, *common, *stop_at, "--job.dump_folder", str(folder))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "warning: taking over the stale lock" in resumed.stderr and f"at step {step}" in resumed.stdout
    assert not (folder / "LOCK").exists()  # released after the SIGTERM stop too
    straight = run_trainer(1, *common, *stop_at, "--job.dump_folder", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference, got = losses(tmp_path / "straight"), losses(folder)
    assert list(got) == list(range(1, step + 4))
    assert [got[s] for s in got] == [reference[s] for s in got]  # bit-identical, before and after the stop


@pytest.mark.slow
def test_a_second_job_on_a_locked_folder_exits_2_and_leaves_it_untouched(tmp_path, live_pid):
    plant_lock(tmp_path, pid=live_pid)
    proc = run_trainer(1, *TINY, "--training.steps", "2", "--job.dump_folder", str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: job.dump_folder {tmp_path} is in use by another training job: host" in proc.stderr
    assert f"pid {live_pid}" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LOCK"]


@pytest.mark.slow
def test_two_ranks_on_a_locked_folder_both_refuse_without_hanging(tmp_path, live_pid):
    plant_lock(tmp_path, pid=live_pid)
    began = time.time()
    proc = run_trainer(2, *TINY, "--training.steps", "2", "--job.dump_folder", str(tmp_path), timeout=120)
    assert proc.returncode != 0 and time.time() - began < 60
    # Both ranks learn it from rank 0 and print it; torchrun reports the first exit (2) as the root cause
    # and may SIGTERM the other rank while it is already on its way out.
    assert proc.stderr.count(f"error: job.dump_folder {tmp_path} is in use by another training job") == 2
    assert "exitcode  : 2" in proc.stderr
    codes = {int(c) for c in re.findall(r"exitcode\s+: (-?\d+)", proc.stderr)}
    assert codes <= {2, -signal.SIGTERM}, proc.stderr[-3000:]


def trainers_of(marker: str, launcher: int) -> list[int]:
    """The live trainer processes whose command line holds `marker`, torchrun excepted (zombies do not count)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == launcher:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"atma_titan.train" in cmdline and marker.encode() in cmdline and _state(int(entry.name)) not in ("", "Z"):
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_sigkill_of_torchrun_stops_its_trainers_and_a_restart_resumes(tmp_path):
    folder = tmp_path / "orphans"
    # Too many steps to finish within the test's 15 s: only a stop ends the orphans in time.
    args = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "1000", "--job.dump_folder", str(folder)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    with open(tmp_path / "log", "w") as log:  # a file, not a pipe: the trainers outlive this reader
        proc = subprocess.Popen(
            [*torchrun, "-m", "atma_titan.train", *args, "--training.steps", "1000"],
            cwd=ROOT,
            env=trainer_env(),
            stdout=log,
            stderr=log,
        )
        wait_for_rows(folder, 3, proc)
        assert len(trainers_of(str(folder), proc.pid)) == 2
        proc.kill()
        proc.wait()
        deadline = time.time() + 15
        while trainers_of(str(folder), proc.pid) and time.time() < deadline:
            time.sleep(0.1)
    left = trainers_of(str(folder), proc.pid)
    for pid in left:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    log_text = (tmp_path / "log").read_text()
    assert not left, f"trainers {left} still running 15 s after torchrun was killed\n{log_text[-3000:]}"
    assert log_text.count("received SIGTERM: finishing this step") == 2  # both ranks, from the kernel
    [step] = saved_steps(folder)  # the orphans saved their last step before leaving
    assert f"stopped at step {step} on request (SIGTERM)" in log_text
    assert not (folder / "DONE").exists() and not (folder / "LOCK").exists()
    restarted = run_trainer(2, *args, "--training.steps", str(step + 2))  # resumes, and finishes soon
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert f"resumed from {folder}/checkpoints/step-{step} at step {step}" in restarted.stdout
    assert (folder / "DONE").read_text() == f"{step + 2}\n"
