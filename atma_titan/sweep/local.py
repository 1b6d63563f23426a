"""Running cells here, one after another or several at once (--jobs): the train and eval commands,
their stages, failures, and a graceful stop on SIGTERM / SIGINT.

Each command runs in the plan's workdir with absolute cell paths, so that the sweep works the
same from any current directory.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from atma_titan.sweep.cells import EVAL_LOG, TRAIN_LOG, CellFolder
from atma_titan.sweep.collect import collect
from atma_titan.sweep.plan import Cell, Plan, SweepError, config_argv
from atma_titan.sweep import progress

LOG_TAIL_LINES = 40
# Needle / records trials per gap and depth unless --eval-args set --trials: at 256 the binomial
# standard error of a recall is at most 3.1 points (at 20, the eval's own default, 11), so that a
# cell's number does not move by tens of points with the evaluation seed.
EVAL_TRIALS = 256


class SweepStop:
    """A stop request (SIGTERM / SIGINT) for the sweep; forwarded to every running child as SIGTERM."""

    signum: int | None = None
    children: set[subprocess.Popen] = set()  # one per cell running (several with --jobs)

    @classmethod
    def handler(cls, signum, frame) -> None:
        cls.signum = signum
        for child in list(cls.children):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)  # the trainer checkpoints and exits; a repeat aborts

    @classmethod
    def install(cls) -> dict:
        return {s: signal.signal(s, cls.handler) for s in (signal.SIGTERM, signal.SIGINT)}


class Command(list):
    """An argv list that also names the directory it runs in (None: the current one).
    A list, so that stand-ins for `spawn` can read it like any argv."""

    def __init__(self, argv: list[str], cwd: str | None = None):
        super().__init__(argv)
        self.cwd = cwd


def spawn(cmd: list[str], log_path: Path) -> int:
    """Run `cmd` with stdout and stderr appended to `log_path`; return its exit status.
    The child gets its own session, so a terminal's Ctrl-C reaches only the sweep, which turns it
    into a graceful SIGTERM for the child instead of a KeyboardInterrupt mid-checkpoint."""
    cwd = getattr(cmd, "cwd", None)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} in {cwd or os.getcwd()} $ {shlex.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
        SweepStop.children.add(child)
        try:
            return child.wait()
        finally:
            SweepStop.children.discard(child)


def absolute(path: Path) -> str:
    return os.path.abspath(path)  # not resolve(): keep the user's symlinks in logs and messages


def train_command(plan: Plan, cell: Cell, out: Path, launcher: str | None) -> list[str]:
    prefix = shlex.split(launcher) if launcher else [sys.executable]
    overrides = plan.fixed + list(cell.config_overrides)  # with --seeds: the run's job.seed last
    argv = [*prefix, "-m", "atma_titan.train", *config_argv(plan.base, overrides)]
    argv += ["--job.dump_folder", absolute(CellFolder.of(out, cell).run_dir), "--checkpoint.enable", "true"]
    return Command(argv, cwd=plan.workdir)


def eval_command(plan: Plan, cell: Cell, out: Path) -> list[str]:
    folder = CellFolder.of(out, cell)
    extra = shlex.split(plan.eval_args)
    argv = [sys.executable, "-m", "atma_titan.eval", "--checkpoint", absolute(folder.run_dir)]
    argv += ["--out", absolute(folder.eval_dir), "--name", cell.name]
    if not any(a == "--trials" or a.startswith("--trials=") for a in extra):  # one --trials in the logged command
        argv += ["--trials", str(EVAL_TRIALS)]
    return Command(argv + extra, cwd=plan.workdir)


# ---------------------------------------------------------------------------------------------
# Stages and failures


def log_tail(log_path: Path, offset: int, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines this attempt wrote to the log (it is appended across attempts)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def record_failure(folder: CellFolder, stage: str, reason: str, cmd: list[str], log_path: Path, offset: int) -> str:
    tail = log_tail(log_path, offset)
    folder.failed.write_text(
        f"{stage}: {reason}\n"
        f"time: {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        f"command: {shlex.join(cmd)}\n"
        f"log: {log_path}\n"
        f"--- last {LOG_TAIL_LINES} lines of the log ---\n{tail}\n"
    )
    return tail


def run_stage(stage: str, cmd: list[str], folder: CellFolder, log_name: str, check) -> tuple[bool, str]:
    """Run one stage of a cell. Returns (ok, message). `check()` says what is missing after exit 0."""
    if SweepStop.signum is not None:  # asked to stop between two stages: do not start the next
        return False, "stopped on request"
    log_path = folder.path / log_name
    offset = log_path.stat().st_size if log_path.exists() else 0
    start = time.monotonic()
    rc = spawn(cmd, log_path)
    elapsed = time.monotonic() - start
    if SweepStop.signum is not None:
        return False, f"stopped on request after {elapsed:.1f} s"
    if rc == 0 and check() is None:
        return True, f"{elapsed:.1f} s"
    reason = f"exited with status {rc}" if rc != 0 else check()
    tail = record_failure(folder, stage, reason, cmd, log_path, offset)
    shown = "\n".join("    " + line for line in tail.splitlines()[-10:])
    return False, f"{stage} {reason}; see {log_path}\n{shown}"


def report_failure(tag: str, message: str) -> str:
    if SweepStop.signum is not None:
        print(f"{tag}: {message}; re-run to resume", flush=True)
        return "stopped"
    print(f"{tag}: FAILED: {message}", flush=True)
    return "failed"


# ---------------------------------------------------------------------------------------------
# A cell, and the sweep


def train_cell(plan: Plan, cell: Cell, out: Path, tag: str, launcher: str | None) -> str | None:
    """Train (or resume) a cell; None when it is trained, else the outcome (failed | stopped)."""
    folder = CellFolder.of(out, cell)
    folder.results.unlink(missing_ok=True)  # the weights will change: an old evaluation is stale
    resume = folder.latest_checkpoint_step()
    print(f"{tag}: training{f' (resuming from step {resume})' if resume else ''} ...", flush=True)
    watch = progress.TrainProgress(folder.run, lambda line: print(f"{tag}: {line}", flush=True))
    with progress.Every(watch.poll, progress.PROGRESS_INTERVAL_S):
        ok, message = run_stage(
            "train",
            train_command(plan, cell, out, launcher),
            folder,
            TRAIN_LOG,
            lambda: None if folder.trained() else "stopped before the last step (no run/DONE)",
        )
    if not ok:
        return report_failure(tag, message)
    last = folder.final_train_metrics()
    loss = f", final loss {last['loss']:.4f} at step {last.get('step')}" if last else ""
    print(f"{tag}: trained in {message}{loss}", flush=True)
    return None


def evaluate_cell(plan: Plan, cell: Cell, out: Path, tag: str) -> str:
    folder = CellFolder.of(out, cell)
    print(f"{tag}: evaluating ...", flush=True)
    ok, message = run_stage(
        "eval",
        eval_command(plan, cell, out),
        folder,
        EVAL_LOG,
        lambda: None if folder.evaluated() else f"exited 0 but wrote no {folder.results}",
    )
    if not ok:
        return report_failure(tag, message)
    print(f"{tag}: evaluated in {message}", flush=True)
    return "ok"


def run_cell(plan: Plan, cell: Cell, out: Path, *, evaluate: bool, launcher: str | None) -> str:
    """Bring one cell to done (or trained with --no-eval). Returns ok | skipped | failed | stopped."""
    folder = CellFolder.of(out, cell)
    tag = f"[{cell.index + 1}/{len(plan.cells)}] {cell.name}"
    status = folder.status(need_eval=evaluate)
    if status == "done" or (status == "trained" and not evaluate):
        print(f"{tag}: {status}, skipping", flush=True)
        return "skipped"
    folder.path.mkdir(parents=True, exist_ok=True)
    folder.failed.unlink(missing_ok=True)  # a re-run retries a failed cell
    if not folder.trained():
        outcome = train_cell(plan, cell, out, tag, launcher)
        if outcome is not None:
            return outcome
    return evaluate_cell(plan, cell, out, tag) if evaluate else "ok"


def run_cells(plan: Plan, cells: list[Cell], out: Path, jobs: int, **options) -> dict[str, list[str]]:
    """Each cell's outcome, the cells run `jobs` at a time (each its own train / eval processes); after a
    stop request no further cell starts."""
    outcomes: dict[str, list[str]] = {}

    def one(cell: Cell) -> None:
        if SweepStop.signum is None:
            outcomes.setdefault(run_cell(plan, cell, out, **options), []).append(cell.name)

    if jobs == 1:
        for cell in cells:
            one(cell)
            if "stopped" in outcomes:
                break
        return outcomes
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="cell") as pool:
        pending = {pool.submit(one, cell) for cell in cells}
        while pending:  # a timed wait: the main thread stays free to take a signal
            done, pending = wait(pending, timeout=0.5)
            for future in done:
                future.result()  # a cell's unexpected error ends the sweep, as it does one cell at a time
    return outcomes


def run_sweep(
    plan: Plan, out: Path, *, cell_index: int | None, evaluate: bool, launcher: str | None, jobs: int = 1
) -> int:
    """Run the cells (or one), `jobs` at a time, then collect. Exit status: 0, 1 (a cell failed), 128 + signal
    (stopped)."""
    if cell_index is not None and not 0 <= cell_index < len(plan.cells):
        raise SweepError(f"--cell {cell_index}: the sweep has cells 0..{len(plan.cells) - 1}.")
    if not os.path.isdir(plan.workdir):  # e.g. the sweep folder was copied to another machine
        raise SweepError(
            f"the plan's workdir {plan.workdir} (where the sweep was planned; the cells run there) does not "
            "exist: run from an existing directory with the plan options and --force-plan to plan anew."
        )
    cells = plan.cells if cell_index is None else [plan.cells[cell_index]]
    old_handlers = SweepStop.install()
    SweepStop.signum = None
    try:
        outcomes = run_cells(plan, cells, out, jobs, evaluate=evaluate, launcher=launcher)
    finally:
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
    counts = ", ".join(f"{len(v)} {k}" for k, v in outcomes.items())
    print(f"sweep {out}: {len(cells)} cell(s) this run: {counts}", flush=True)
    if SweepStop.signum is not None:
        return 128 + SweepStop.signum
    collect(plan, out)
    if outcomes.get("failed"):
        print(f"failed: {', '.join(outcomes['failed'])} (details in each cell's FAILED)", flush=True)
        return 1
    return 0
