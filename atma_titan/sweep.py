"""Ablation sweeps: a factorial over config keys, each cell a full training run plus evaluation.

    python -m atma_titan.sweep [run] --base train_configs/atma_370m.toml --out sweeps/ablation \\
        --factor model.attention=polar,softmax --factor model.memory=[true,false] \\
        --set training.steps=1900 --eval-args "--gaps 2048,4096,8192 --trials 32 --length-curve"
    python -m atma_titan.sweep run --out sweeps/ablation            # resume the saved plan (sweep.json)
    python -m atma_titan.sweep run --out sweeps/ablation --cell 3   # one cell (a SLURM array task runs this)
    python -m atma_titan.sweep list --out sweeps/ablation           # cells: index, status, name, loss
    python -m atma_titan.sweep collect --out sweeps/ablation        # results.md / .csv, needle.png, length_curve.png
    python -m atma_titan.sweep slurm --base ... --factor ... --out sweeps/ablation --max-parallel 4 [--dry-run]

The cells are the Cartesian product of the `--factor section.key=v1,v2,...` values (the first factor
varies slowest), each named from its values (`attention-polar_memory-true`) with its own folder
`<out>/cells/<name>/`: `run/` (the trainer's dump folder), `eval/` (the eval command's output),
`train.log`, `eval.log`, and `FAILED` after a failure. Every cell's config is checked with the
project's own loader before anything runs (a bad key or value: the loader's message, exit 2).

`<out>/sweep.json` holds the plan (base file and its sha256, factors, `--set` overrides, eval
args, cells). A later command with a different plan into the same folder is refused unless
`--force-plan`; commands given only `--out` use the saved plan. A combination the config rejects
(e.g. the distractor loss with softmax attention) is an error, or left out with `--skip-invalid`.

A cell is done when `run/DONE` and `eval/results.json` exist, and is then skipped; a trained cell
only runs its evaluation; a partly trained one resumes from its checkpoints (checkpointing is
always on in a sweep). A failed cell is recorded in `FAILED` (stage, exit status, log tail), the
sweep goes on with the next cell and exits 1 at the end; a re-run retries it. SIGTERM or Ctrl-C
asks the running trainer to checkpoint and stop (a second one after 2 s aborts it), records no
failure and exits 128 + the signal number.

Exit status: 0 all requested cells finished, 1 some cell failed, 2 a bad plan or option.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLAN_FILE = "sweep.json"
PLAN_VERSION = 1
DONE_MARKER = "DONE"  # written by atma_titan.train after the last step
RESULTS_FILE = "results.json"  # written by atma_titan.eval
FAILED_MARKER = "FAILED"
LOG_TAIL_LINES = 40
SBATCH_SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "sweep_array.sbatch"
# Keys the sweep sets itself for every cell: a factor or --set on them would be silently overridden.
RESERVED_KEYS = {
    "job.dump_folder": "each cell trains into <out>/cells/<name>/run",
    "checkpoint.enable": "checkpointing is always on in a sweep, so that a stopped cell resumes",
}
COMMANDS = ("run", "list", "collect", "slurm")


class SweepError(Exception):
    """A bad plan, option or sweep folder: reported as `error: ...` with exit status 2."""


# ---------------------------------------------------------------------------------------------
# The plan: factors -> cells


@dataclass(frozen=True)
class Factor:
    key: str  # "section.key"
    values: tuple[str, ...]  # as the user wrote them: passed to the trainer as given

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0]

    @property
    def key_name(self) -> str:
        return self.key.split(".", 1)[1]


@dataclass(frozen=True)
class Cell:
    index: int
    name: str
    overrides: tuple[tuple[str, str], ...]  # (section.key, value) for each factor, in factor order


@dataclass
class Plan:
    base: str
    base_sha256: str
    factors: list[Factor]
    fixed: list[tuple[str, str]]
    eval_args: str
    cells: list[Cell]
    skip_invalid: bool = False
    skipped: list[dict] = field(default_factory=list)  # combinations left out by skip_invalid: name, reason

    def identity(self) -> dict:
        """What makes two plans the same (the cells follow from it)."""
        return {
            "base": self.base,
            "base_sha256": self.base_sha256,
            "factors": [{"key": f.key, "values": list(f.values)} for f in self.factors],
            "fixed": [f"{k}={v}" for k, v in self.fixed],
            "eval_args": self.eval_args,
            "skip_invalid": self.skip_invalid,
        }

    def to_json(self) -> dict:
        cells = [{"index": c.index, "name": c.name, "overrides": dict(c.overrides)} for c in self.cells]
        return {"version": PLAN_VERSION, **self.identity(), "cells": cells, "skipped": self.skipped}

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        return cls(
            base=data["base"],
            base_sha256=data["base_sha256"],
            factors=[Factor(f["key"], tuple(f["values"])) for f in data["factors"]],
            fixed=[_split_assignment(s, "--set") for s in data["fixed"]],
            eval_args=data.get("eval_args", ""),
            cells=[Cell(c["index"], c["name"], tuple(c["overrides"].items())) for c in data["cells"]],
            skip_invalid=data.get("skip_invalid", False),
            skipped=data.get("skipped", []),
        )


def _split_assignment(text: str, option: str) -> tuple[str, str]:
    """'section.key=value' -> ('section.key', 'value'), with the key's shape checked."""
    key, eq, value = text.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    if not eq or not re.fullmatch(r"[A-Za-z_]\w*\.[A-Za-z_]\w*", key):
        raise SweepError(f"{option} {text!r}: expected section.key=value (e.g. model.attention=polar).")
    return key, value.strip()


def split_values(text: str) -> list[str]:
    """'a,b,c' or '[a,b,c]' -> ['a', 'b', 'c']; commas inside quotes or brackets do not split,
    so 'model.global_layers="2,6",all' and 'optimizer.adam_betas=[[0.8,0.95],[0.9,0.95]]' work."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]") and _top_level_closes_at_end(text):
        text = text[1:-1]
    values, current, depth, quote = [], "", 0, ""
    for ch in text:
        if quote:
            if ch == quote:
                quote = ""
            else:
                current += ch
        elif ch in "\"'":
            quote = ch
        elif ch == "," and depth == 0:
            values.append(current.strip())
            current = ""
        else:
            depth += (ch == "[") - (ch == "]")
            current += ch
    values.append(current.strip())
    return values


def _top_level_closes_at_end(text: str) -> bool:
    """True when the '[' at text[0] is closed by the ']' at the end (not '[a],[b]')."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth == 0:
            return i == len(text) - 1
    return False


def parse_factor(text: str) -> Factor:
    key, raw = _split_assignment(text, "--factor")
    values = split_values(raw)
    if not raw or any(v == "" for v in values):
        raise SweepError(f"--factor {text!r}: empty value; expected {key}=v1,v2,...")
    return Factor(key, tuple(values))


def _check_reserved(key: str, option: str) -> None:
    if key in RESERVED_KEYS:
        raise SweepError(f"{option} {key}: the sweep sets this key itself ({RESERVED_KEYS[key]}).")


def canonical(value: Any) -> str:
    """A config value as text, the same however it was written ('True', 'yes' -> 'true')."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(canonical(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def safe(text: str) -> str:
    """Filesystem-safe: letters, digits and . _ + - only."""
    return re.sub(r"[^A-Za-z0-9._+-]", "-", text)


def short_keys(factors: list[Factor]) -> dict[str, str]:
    """Factor key -> the short name used in cell names and table headers: the key without its
    section, unless two factors share it (then section_key)."""
    counts: dict[str, int] = {}
    for f in factors:
        counts[f.key_name] = counts.get(f.key_name, 0) + 1
    return {f.key: f.key_name if counts[f.key_name] == 1 else f"{f.section}_{f.key_name}" for f in factors}


def config_argv(base: str, overrides: list[tuple[str, str]]) -> list[str]:
    argv = ["--config", base]
    for key, value in overrides:
        argv += [f"--{key}", value]
    return argv


def validate_cell(base: str, overrides: list[tuple[str, str]]):
    """The cell's resolved config from the project's own loader (raises SweepError with its message)."""
    from atma_titan.config import ConfigError, load_config  # imports torch: only when a plan is built

    try:
        return load_config(config_argv(base, overrides))
    except ConfigError as e:
        raise SweepError(str(e)) from None


def file_sha256(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as e:
        raise SweepError(f"--base {path}: cannot read it ({e.strerror or e}).") from None


def parse_plan_options(
    base: str, factor_texts: list[str], set_texts: list[str], eval_args: str = "", skip_invalid: bool = False
) -> Plan:
    """The command line's plan options, parsed (not yet validated against the config)."""
    if not factor_texts:
        raise SweepError("a sweep needs at least one --factor section.key=v1,v2,...")
    factors = [parse_factor(t) for t in factor_texts]
    fixed = [_split_assignment(t, "--set") for t in set_texts]
    return Plan(os.path.normpath(base), "", factors, fixed, eval_args, [], skip_invalid)


def build_plan(spec: Plan) -> Plan:
    """Validate a plan's options and make its cells; every cell's overrides go through the
    project's load_config before anything runs."""
    base, factors, fixed = spec.base, spec.factors, spec.fixed
    seen: set[str] = set()
    for option, key in [("--factor", f.key) for f in factors] + [("--set", k) for k, _ in fixed]:
        _check_reserved(key, option)
        if key in seen:
            raise SweepError(f"{option} {key}: this key is given more than once (as a factor or with --set).")
        seen.add(key)
    try:
        shlex.split(spec.eval_args)
    except ValueError as e:
        raise SweepError(f"--eval-args {spec.eval_args!r}: {e}") from None
    sha = file_sha256(base)

    validate_cell(base, fixed)  # a bad base file or --set: one message, not one per cell
    labels = factor_labels(base, fixed, factors)
    short = short_keys(factors)
    cells, skipped = [], []
    for values in itertools.product(*(f.values for f in factors)):
        overrides = tuple((f.key, v) for f, v in zip(factors, values))
        name = "_".join(f"{safe(short[f.key])}-{labels[f.key][v]}" for f, v in zip(factors, values))
        try:
            validate_cell(base, fixed + list(overrides))  # combinations: e.g. batch_tokens vs seq_len
        except SweepError as e:
            if spec.skip_invalid:  # e.g. the distractor loss exists only with Polar attention
                skipped.append({"name": name, "reason": str(e)})
                continue
            shown = " ".join(f"{k}={v}" for k, v in overrides)
            raise SweepError(
                f"cell {len(cells) + len(skipped)} ({shown}): {e} (--skip-invalid leaves such combinations out)"
            ) from None
        cells.append(Cell(len(cells), name, overrides))
    if not cells:
        raise SweepError(f"every combination is invalid; the first: {skipped[0]['reason']}")
    return Plan(base, sha, factors, fixed, spec.eval_args, cells, spec.skip_invalid, skipped)


def factor_labels(base: str, fixed: list[tuple[str, str]], factors: list[Factor]) -> dict[str, dict[str, str]]:
    """Factor key -> {value as given: its label in cell names}. The label is the loaded value
    ('True' and 'yes' both give 'true'); two values with the same label are refused."""
    labels: dict[str, dict[str, str]] = {}
    for f in factors:
        labels[f.key] = {}
        given_as: dict[str, str] = {}
        for value in f.values:
            cfg = validate_cell(base, fixed + [(f.key, value)])
            label = safe(canonical(getattr(getattr(cfg, f.section), f.key_name)))
            if label in given_as:
                raise SweepError(
                    f"--factor {f.key}: values {given_as[label]!r} and {value!r} give the same setting "
                    f"or folder name ({label})."
                )
            given_as[label] = value
            labels[f.key][value] = label
    return labels


# ---------------------------------------------------------------------------------------------
# sweep.json


def plan_path(out: Path) -> Path:
    return out / PLAN_FILE


def read_plan(out: Path) -> Plan | None:
    path = plan_path(out)
    if not path.is_file():
        return None
    try:
        return Plan.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise SweepError(f"{path}: not a sweep plan ({e}); move it away or use --force-plan.") from None


def plan_differences(saved: Plan, new: Plan) -> list[str]:
    old_id, new_id = saved.identity(), new.identity()
    diffs = []
    for key in old_id:
        if old_id[key] != new_id[key]:
            if key == "base_sha256" and old_id["base"] == new_id["base"]:
                diffs.append(f"the base file {new.base} has changed since the plan was written")
            elif key != "base_sha256":
                diffs.append(f"{key}: saved {json.dumps(old_id[key])}, now {json.dumps(new_id[key])}")
    return diffs


def write_json_atomic(path: Path, data: dict) -> None:
    """Write via a temporary file and a rename: concurrent array tasks never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_plan(out: Path, plan: Plan, force: bool) -> None:
    saved = read_plan(out) if not force else None
    if saved is not None:
        diffs = plan_differences(saved, plan)
        if diffs:
            raise SweepError(
                f"{plan_path(out)} holds a different plan:\n  - "
                + "\n  - ".join(diffs)
                + "\nUse another --out, or --force-plan to replace the plan (cells with the same name keep "
                "their folders and results)."
            )


def save_plan(out: Path, plan: Plan, force: bool) -> None:
    check_plan(out, plan, force)
    out.mkdir(parents=True, exist_ok=True)
    if force or not plan_path(out).is_file():
        write_json_atomic(plan_path(out), plan.to_json())


def resolve_plan(args: argparse.Namespace, *, write: bool) -> Plan:
    """The plan from the command line (checked against sweep.json), else the one in sweep.json."""
    out = Path(args.out)
    if args.base is None:
        if args.factor or args.set or args.eval_args is not None or args.skip_invalid:
            raise SweepError(
                "--factor, --set, --eval-args and --skip-invalid need --base (or give only --out to use sweep.json)."
            )
        saved = read_plan(out)
        if saved is None:
            raise SweepError(f"no {PLAN_FILE} in {out}: give the plan (--base FILE --factor ...).")
        if not write:
            return saved  # list / collect: read-only, and no torch import
        plan = build_plan(saved)  # re-validated, and the base file checked for changes below
    else:
        options = parse_plan_options(args.base, args.factor, args.set, args.eval_args or "", args.skip_invalid)
        plan = build_plan(options)
    if write:
        save_plan(out, plan, args.force_plan)
    else:
        check_plan(out, plan, args.force_plan)
    return plan


# ---------------------------------------------------------------------------------------------
# Cell folders and status


def cell_dir(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.name


def cell_status(folder: Path, need_eval: bool = True) -> str:
    """done | trained | failed | pending (done without eval counts when need_eval is False)."""
    trained = (folder / "run" / DONE_MARKER).is_file()
    evaluated = (folder / "eval" / RESULTS_FILE).is_file()
    if trained and (evaluated or not need_eval):
        return "done" if evaluated else "trained"
    if (folder / FAILED_MARKER).is_file():
        return "failed"
    return "trained" if trained else "pending"


def final_train_metrics(run_dir: Path) -> dict | None:
    """The last logged step of metrics.jsonl (appended across resumes; the last line is the newest)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    last = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and isinstance(record.get("loss"), (int, float)):
            last = record
    return last


def latest_checkpoint_step(run_dir: Path) -> int | None:
    steps = [
        int(p.name[5:])
        for p in (run_dir / "checkpoints").glob("step-*")
        if p.name[5:].isdigit() and (p / "COMPLETE").exists()
    ]
    return max(steps) if steps else None


# ---------------------------------------------------------------------------------------------
# Running cells


class _Stop:
    """A stop request (SIGTERM / SIGINT) for the sweep; forwarded to the running child as SIGTERM."""

    signum: int | None = None
    child: subprocess.Popen | None = None

    @classmethod
    def handler(cls, signum, frame) -> None:
        cls.signum = signum
        if cls.child is not None and cls.child.poll() is None:
            cls.child.send_signal(signal.SIGTERM)  # the trainer checkpoints and exits; a repeat aborts

    @classmethod
    def install(cls) -> dict:
        return {s: signal.signal(s, cls.handler) for s in (signal.SIGTERM, signal.SIGINT)}


def spawn(cmd: list[str], log_path: Path) -> int:
    """Run `cmd` with stdout and stderr appended to `log_path`; return its exit status.
    The child gets its own session, so a terminal's Ctrl-C reaches only the sweep, which turns it
    into a graceful SIGTERM for the child instead of a KeyboardInterrupt mid-checkpoint."""
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} $ {shlex.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _Stop.child = child
        try:
            return child.wait()
        finally:
            _Stop.child = None


def train_command(plan: Plan, cell: Cell, out: Path, launcher: str | None) -> list[str]:
    prefix = shlex.split(launcher) if launcher else [sys.executable]
    overrides = plan.fixed + list(cell.overrides)
    run_dir = cell_dir(out, cell) / "run"
    return [
        *prefix,
        "-m",
        "atma_titan.train",
        *config_argv(plan.base, overrides),
        "--job.dump_folder",
        str(run_dir),
        "--checkpoint.enable",
        "true",
    ]


def eval_command(plan: Plan, cell: Cell, out: Path) -> list[str]:
    folder = cell_dir(out, cell)
    # The sweep's own arguments first, so that --eval-args can add to them.
    return [
        sys.executable,
        "-m",
        "atma_titan.eval",
        "--checkpoint",
        str(folder / "run"),
        "--out",
        str(folder / "eval"),
        "--name",
        cell.name,
        *shlex.split(plan.eval_args),
    ]


def log_tail(log_path: Path, offset: int, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines this attempt wrote to the log (it is appended across attempts)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def record_failure(folder: Path, stage: str, reason: str, cmd: list[str], log_path: Path, offset: int) -> str:
    tail = log_tail(log_path, offset)
    (folder / FAILED_MARKER).write_text(
        f"{stage}: {reason}\n"
        f"time: {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        f"command: {shlex.join(cmd)}\n"
        f"log: {log_path}\n"
        f"--- last {LOG_TAIL_LINES} lines of the log ---\n{tail}\n"
    )
    return tail


def _log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def run_stage(stage: str, cmd: list[str], folder: Path, log_name: str, check) -> tuple[bool, str]:
    """Run one stage of a cell. Returns (ok, message). `check()` says what is missing after exit 0."""
    if _Stop.signum is not None:  # asked to stop between two stages: do not start the next
        return False, "stopped on request"
    log_path = folder / log_name
    offset = _log_size(log_path)
    start = time.monotonic()
    rc = spawn(cmd, log_path)
    elapsed = time.monotonic() - start
    if _Stop.signum is not None:
        return False, f"stopped on request after {elapsed:.1f} s"
    if rc == 0 and check() is None:
        return True, f"{elapsed:.1f} s"
    reason = f"exited with status {rc}" if rc != 0 else check()
    tail = record_failure(folder, stage, reason, cmd, log_path, offset)
    shown = "\n".join("    " + line for line in tail.splitlines()[-10:])
    return False, f"{stage} {reason}; see {log_path}\n{shown}"


def run_cell(plan: Plan, cell: Cell, out: Path, *, evaluate: bool, launcher: str | None) -> str:
    """Bring one cell to done (or trained with --no-eval). Returns ok | skipped | failed | stopped."""
    folder = cell_dir(out, cell)
    tag = f"[{cell.index + 1}/{len(plan.cells)}] {cell.name}"
    status = cell_status(folder, need_eval=evaluate)
    if status in ("done", "trained") and (status == "done" or not evaluate):
        print(f"{tag}: {status}, skipping", flush=True)
        return "skipped"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FAILED_MARKER).unlink(missing_ok=True)  # a re-run retries a failed cell
    run_dir, results = folder / "run", folder / "eval" / RESULTS_FILE

    if not (run_dir / DONE_MARKER).is_file():
        results.unlink(missing_ok=True)  # the weights will change: an old evaluation is stale
        resume = latest_checkpoint_step(run_dir)
        print(f"{tag}: training{f' (resuming from step {resume})' if resume else ''} ...", flush=True)
        ok, message = run_stage(
            "train",
            train_command(plan, cell, out, launcher),
            folder,
            "train.log",
            lambda: None if (run_dir / DONE_MARKER).is_file() else "stopped before the last step (no run/DONE)",
        )
        if not ok:
            return _report_failure(tag, message)
        last = final_train_metrics(run_dir)
        loss = f", final loss {last['loss']:.4f} at step {last.get('step')}" if last else ""
        print(f"{tag}: trained in {message}{loss}", flush=True)

    if not evaluate:
        return "ok"
    print(f"{tag}: evaluating ...", flush=True)
    ok, message = run_stage(
        "eval",
        eval_command(plan, cell, out),
        folder,
        "eval.log",
        lambda: None if results.is_file() else f"exited 0 but wrote no {results}",
    )
    if not ok:
        return _report_failure(tag, message)
    print(f"{tag}: evaluated in {message}", flush=True)
    return "ok"


def _report_failure(tag: str, message: str) -> str:
    if _Stop.signum is not None:
        print(f"{tag}: {message}; re-run to resume", flush=True)
        return "stopped"
    print(f"{tag}: FAILED: {message}", flush=True)
    return "failed"


def check_eval_available() -> None:
    """Fail before hours of training when the eval command is missing (train only: --no-eval)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("atma_titan.eval.__main__") is not None
    except ImportError:
        found = False
    if not found:
        raise SweepError("the eval command (python -m atma_titan.eval) is not available; use --no-eval to train only.")


def run_sweep(plan: Plan, out: Path, *, cell_index: int | None, evaluate: bool, launcher: str | None) -> int:
    if cell_index is not None and not 0 <= cell_index < len(plan.cells):
        raise SweepError(f"--cell {cell_index}: the sweep has cells 0..{len(plan.cells) - 1}.")
    if evaluate:
        check_eval_available()
    cells = plan.cells if cell_index is None else [plan.cells[cell_index]]
    old_handlers = _Stop.install()
    _Stop.signum = None
    outcomes: dict[str, list[str]] = {}
    try:
        for cell in cells:
            if _Stop.signum is not None:
                break
            outcome = run_cell(plan, cell, out, evaluate=evaluate, launcher=launcher)
            outcomes.setdefault(outcome, []).append(cell.name)
            if outcome == "stopped":
                break
    finally:
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
    counts = ", ".join(f"{len(v)} {k}" for k, v in outcomes.items())
    print(f"sweep {out}: {len(cells)} cell(s) this run: {counts}", flush=True)
    if _Stop.signum is not None:
        return 128 + _Stop.signum
    collect(plan, out)
    if outcomes.get("failed"):
        print(f"failed: {', '.join(outcomes['failed'])} (details in each cell's FAILED)", flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# list


def list_cells(plan: Plan, out: Path) -> str:
    rows = [("#", "status", "train loss", "name")]
    for cell in plan.cells:
        folder = cell_dir(out, cell)
        status = cell_status(folder)
        last = final_train_metrics(folder / "run")
        loss = f"{last['loss']:.4f}" if last else "-"
        if status == "pending" and (step := latest_checkpoint_step(folder / "run")):
            status = f"pending (checkpoint at step {step})"
        elif status == "failed":
            status = "failed: " + (folder / FAILED_MARKER).read_text().splitlines()[0]
        rows.append((str(cell.index), status, loss, cell.name))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(f"{r[0]:>{width[0]}}  {r[3]:<{width[3]}}  {r[2]:>{width[2]}}  {r[1]}" for r in rows)


# ---------------------------------------------------------------------------------------------
# collect: the results table and the comparison plots


def read_results(folder: Path) -> dict | None:
    path = folder / "eval" / RESULTS_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def needle_accuracy(results: dict) -> dict[tuple[str, int], float]:
    """(variant, gap) -> per-digit accuracy, the trial-weighted mean over needle depths."""
    sums: dict[tuple[str, int], list[float]] = {}
    for row in results.get("needle") or []:
        try:
            key = (str(row.get("variant", "access")), int(row["gap"]))
            weight = float(row.get("trials") or 1)
            acc = float(row["digit_acc"])
        except (KeyError, TypeError, ValueError):
            continue
        total = sums.setdefault(key, [0.0, 0.0])
        total[0] += acc * weight
        total[1] += weight
    return {k: s / w for k, (s, w) in sums.items() if w > 0}


def length_nll(results: dict) -> dict[int, float]:
    curve = results.get("length_curve") or {}
    try:
        return {int(n): float(v) for n, v in zip(curve.get("lengths") or [], curve.get("nll") or [])}
    except (TypeError, ValueError):
        return {}


def short_length(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass
class Table:
    header_md: list[str]
    header_csv: list[str]
    rows_md: list[list[str]]
    rows_csv: list[list[Any]]


def results_table(plan: Plan, out: Path) -> tuple[Table, dict[str, dict]]:
    """One row per cell: factor values, status, final train loss, accuracy per gap, NLL per length."""
    per_cell = []
    for cell in plan.cells:
        folder = cell_dir(out, cell)
        results = read_results(folder) if cell_status(folder) == "done" else None
        per_cell.append((cell, cell_status(folder), final_train_metrics(folder / "run"), results))
    accs = {c.name: needle_accuracy(r) for c, _, _, r in per_cell if r}
    nlls = {c.name: length_nll(r) for c, _, _, r in per_cell if r}
    acc_keys = sorted({k for a in accs.values() for k in a}, key=lambda k: (k[0] != "access", k[0], k[1]))
    lengths = sorted({n for v in nlls.values() for n in v})
    one_variant = len({v for v, _ in acc_keys}) <= 1

    short = short_keys(plan.factors)
    acc_md = [f"acc@{short_length(g)}" if one_variant else f"{v} acc@{short_length(g)}" for v, g in acc_keys]
    table = Table(
        header_md=["#", *(short[f.key] for f in plan.factors), "status", "train loss", *acc_md]
        + [f"NLL@{short_length(n)}" for n in lengths],
        header_csv=["index", "name", *(f.key for f in plan.factors), "status", "final_step", "final_train_loss"]
        + [f"digit_acc_{v}@{g}" for v, g in acc_keys]
        + [f"nll@{n}" for n in lengths],
        rows_md=[],
        rows_csv=[],
    )
    for cell, status, last, results in per_cell:
        acc, nll = accs.get(cell.name, {}), nlls.get(cell.name, {})
        values = [v for _, v in cell.overrides]
        loss = last["loss"] if last else None
        table.rows_md.append(
            [str(cell.index), *values, status, _fmt(loss, "{:.4f}")]
            + [_fmt(None if k not in acc else 100 * acc[k], "{:.1f}") for k in acc_keys]
            + [_fmt(nll.get(n), "{:.3f}") for n in lengths]
        )
        table.rows_csv.append(
            [cell.index, cell.name, *values, status, last.get("step") if last else "", _blank(loss)]
            + [_blank(acc.get(k)) for k in acc_keys]
            + [_blank(nll.get(n)) for n in lengths]
        )
    return table, {c.name: r for c, _, _, r in per_cell if r}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _blank(value: Any) -> Any:
    return "" if value is None else value


def markdown(plan: Plan, out: Path, table: Table, plots: list[str]) -> str:
    def row(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    statuses = [r[len(plan.factors) + 1] for r in table.rows_md]
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in ("done", "trained", "failed", "pending") if s in statuses)
    fixed = ", ".join(f"`{k}={v}`" for k, v in plan.fixed) or "none"
    lines = [
        f"# Sweep {out}",
        "",
        f"Base config `{plan.base}`; fixed overrides: {fixed}; eval args: `{plan.eval_args or '(defaults)'}`.",
        f"{len(plan.cells)} cells: {counts}.",
        "",
        row(table.header_md),
        row(["---"] * len(table.header_md)),
        *(row(r) for r in table.rows_md),
        "",
        "train loss: the last logged training loss. acc@gap: per-digit accuracy (%) of the induction needle at "
        "that gap, averaged over needle depths. NLL@length: mean per-token NLL of the length curve. "
        "`-`: not available (cell not finished, or not measured).",
    ]
    if plots:
        lines += ["", *(f"![{Path(p).stem}]({Path(p).name})" for p in plots)]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, table: Table) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(table.header_csv)
    writer.writerows(table.rows_csv)
    write_text_atomic(path, buffer.getvalue())


def plot_comparisons(results_by_name: dict[str, dict], out: Path) -> list[Path]:
    """needle.png and length_curve.png over all evaluated cells, with atma_titan.eval.report's
    plots when it is importable, else simple ones of our own."""
    os.environ.setdefault("MPLBACKEND", "Agg")  # no display on a cluster node
    theirs = _report_plots()
    ours = {"needle": _plot_needle, "length_curve": _plot_lengths}
    written = []
    for kind in ("needle", "length_curve"):
        if not any(r.get(kind) for r in results_by_name.values()):
            continue
        path = out / f"{kind}.png"
        try:
            _draw(theirs.get(kind), ours[kind], results_by_name, path)
        except ImportError as e:
            print(f"warning: no plots ({e}); pip install matplotlib", flush=True)
            break
        written.append(path)
    return written


def _report_plots() -> dict:
    """The eval command's multi-model plots, by kind; {} when they cannot be imported."""
    try:
        from atma_titan.eval import report

        return {"needle": report.plot_needle, "length_curve": report.plot_length_curves}
    except Exception:  # not written yet, or broken: the sweep's table must still come out
        return {}


def _draw(theirs, ours, results_by_name: dict[str, dict], path: Path) -> None:
    if theirs is not None:
        try:
            return theirs(results_by_name, path)
        except Exception as e:  # a plotting bug must not lose the sweep's table
            print(f"warning: atma_titan.eval.report failed on {path.name} ({e!r}); drawing a simple plot", flush=True)
    ours(results_by_name, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_needle(results_by_name: dict[str, dict], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    variants = {v for r in results_by_name.values() for v, _ in needle_accuracy(r)}
    for name, results in results_by_name.items():
        acc = needle_accuracy(results)
        for variant in sorted(variants):
            gaps = sorted(g for v, g in acc if v == variant)
            if gaps:
                label = name if len(variants) == 1 else f"{name} ({variant})"
                ax.plot(gaps, [100 * acc[(variant, g)] for g in gaps], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="gap (tokens)", ylabel="per-digit accuracy (%)", ylim=(-2, 102), title="Induction needle")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_lengths(results_by_name: dict[str, dict], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, results in results_by_name.items():
        nll = length_nll(results)
        if nll:
            lengths = sorted(nll)
            ax.plot(lengths, [nll[n] for n in lengths], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context length (tokens)", ylabel="mean NLL per token", title="Length curve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def collect(plan: Plan, out: Path) -> list[Path]:
    table, results_by_name = results_table(plan, out)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_comparisons(results_by_name, out)
    md, csv_path = out / "results.md", out / "results.csv"
    write_text_atomic(md, markdown(plan, out, table, [str(p) for p in plots]))
    write_csv(csv_path, table)
    written = [md, csv_path, *plots]
    print(f"collected {len(results_by_name)} evaluated cell(s): " + ", ".join(str(p) for p in written), flush=True)
    return written


# ---------------------------------------------------------------------------------------------
# slurm


def forwarded_args(args: argparse.Namespace) -> list[str]:
    """The arguments each array task passes to `sweep run --cell N`: the plan and runtime options."""
    argv = ["--out", args.out]
    if args.base is not None:
        argv += ["--base", args.base]
        argv += [f"--factor={f}" for f in args.factor]
        argv += [f"--set={s}" for s in args.set]
        if args.eval_args:
            argv.append(f"--eval-args={args.eval_args}")
        if args.skip_invalid:
            argv.append("--skip-invalid")
    if args.no_eval:
        argv.append("--no-eval")
    if args.launcher:
        argv.append(f"--launcher={args.launcher}")
    return argv


def sbatch_command(args: argparse.Namespace, n_cells: int) -> list[str]:
    array = f"0-{n_cells - 1}" + (f"%{args.max_parallel}" if args.max_parallel else "")
    script = os.path.relpath(SBATCH_SCRIPT) if SBATCH_SCRIPT.is_relative_to(Path.cwd()) else str(SBATCH_SCRIPT)
    return ["sbatch", f"--array={array}", *shlex.split(args.sbatch_args or ""), script, *forwarded_args(args)]


def submit(args: argparse.Namespace) -> int:
    plan = resolve_plan(args, write=not args.dry_run)
    cmd = sbatch_command(args, len(plan.cells))
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    Path("logs").mkdir(exist_ok=True)  # SLURM opens logs/%x-%A_%a.out before the script runs
    print(f"submitting {len(plan.cells)} cells: {shlex.join(cmd)}", flush=True)
    try:
        return subprocess.run(cmd).returncode
    except FileNotFoundError:
        raise SweepError("sbatch not found: run this on a SLURM login node (or use --dry-run).") from None


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m atma_titan.sweep",
        description="Ablation sweeps: a factorial over config keys, each cell trained and evaluated.",
        epilog="The command defaults to run. Run `python -m atma_titan.sweep COMMAND -h` for its options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{run,list,collect,slurm}")
    helps = {
        "run": "train and evaluate every cell (or one with --cell) here, one after another, then collect",
        "list": "print the cells with index, name, loss and status (done/trained/pending/failed)",
        "collect": "write results.md, results.csv, needle.png and length_curve.png from the finished cells",
        "slurm": "submit the cells as a SLURM job array (launch/sweep_array.sbatch)",
    }
    for name in COMMANDS:
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        p.add_argument("--out", required=True, help="the sweep folder (holds sweep.json and cells/)")
        p.add_argument("--base", help="base TOML config of every cell (omit to use the plan in sweep.json)")
        p.add_argument(
            "--factor",
            action="append",
            default=[],
            metavar="SECTION.KEY=V1,V2",
            help="a factor of the sweep: section.key=v1,v2,... or section.key=[v1,v2] (repeat for more factors)",
        )
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="a fixed override for every cell (repeatable)",
        )
        p.add_argument("--eval-args", help='extra arguments of the eval command, e.g. "--gaps 2048,4096 --trials 8"')
        p.add_argument(
            "--skip-invalid",
            action="store_true",
            help="leave out factor combinations the config rejects (default: such a combination is an error)",
        )
        p.add_argument("--force-plan", action="store_true", help="replace a different plan in sweep.json")
        if name in ("run", "slurm"):
            p.add_argument("--no-eval", action="store_true", help="train only; a cell counts as finished once trained")
            p.add_argument(
                "--launcher", help='training launcher instead of plain python, e.g. "torchrun --nproc_per_node=8"'
            )
        if name == "run":
            p.add_argument("--cell", type=int, metavar="INDEX", help="run only this cell (what an array task runs)")
        if name == "slurm":
            p.add_argument("--max-parallel", type=int, default=0, help="at most N array tasks at once (0: no limit)")
            p.add_argument("--sbatch-args", help='extra sbatch options, e.g. "--time=04:00:00 -p gpu"')
            p.add_argument("--dry-run", action="store_true", help="print the sbatch command instead of running it")
    return parser


# Options whose values are command lines themselves ("--gaps 2048", "--time=1:00:00"): argparse
# would take a value that starts with '-' for an option, so they are joined as --opt=value first.
COMMAND_LINE_OPTIONS = ("--eval-args", "--launcher", "--sbatch-args")


def parse_args(argv: list[str]) -> argparse.Namespace:
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = ["run", *argv]
    joined, i = [], 0
    while i < len(argv):
        if argv[i] in COMMAND_LINE_OPTIONS and i + 1 < len(argv):
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    return build_parser().parse_args(joined)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    try:
        if args.command == "run":
            plan = resolve_plan(args, write=True)
            if plan.skipped:
                names = ", ".join(s["name"] for s in plan.skipped)
                print(f"left out {len(plan.skipped)} invalid combination(s) (--skip-invalid): {names}", flush=True)
            return run_sweep(plan, out, cell_index=args.cell, evaluate=not args.no_eval, launcher=args.launcher)
        if args.command == "list":
            plan = resolve_plan(args, write=False)
            print(f"sweep {out}: {len(plan.cells)} cells, base {plan.base}")
            print(list_cells(plan, out))
            for skipped in plan.skipped:
                print(f"left out (--skip-invalid): {skipped['name']}: {skipped['reason']}")
            return 0
        if args.command == "collect":
            collect(resolve_plan(args, write=False), out)
            return 0
        return submit(args)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
