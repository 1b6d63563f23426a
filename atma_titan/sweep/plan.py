"""The plan of a sweep: factors -> cells, each cell's config checked by the project's loader, and
its record <out>/sweep.json (read, compared with a new plan, written).

sweep.json (version 3)::

    {"version": 3, "base": "/abs/path/base.toml", "base_sha256": "...",
     "factors": [{"key": "model.attention", "values": ["polar", "softmax"]}, ...],
     "fixed": ["training.steps=1900", ...], "eval_args": "...", "skip_invalid": false,
     "seeds": [0, 1, 2] | null,
     "workdir": "/abs/dir/the/plan/was/made/in",
     "cells": [{"index": 0, "name": "attention-polar_seed-0", "overrides": {"model.attention": "polar"},
                "group": "attention-polar", "seed": 0}, ...],
     "skipped": [{"name": ..., "reason": ...}]}

"cells" are the runs, one folder each. With "seeds" every factor combination (its name is the
run's "group") is one run per seed, differing only in job.seed, named `<group>_seed-<seed>`; the
seed varies fastest. Without seeds ("seeds": null) a run is its combination, with no "group" or
"seed" key, as in version 2. Version 2 (no "seeds") and version 1 (no "workdir", "base" as the
user typed it: relative to the current directory, which is also the workdir) still load.

Torch-free until a plan is built: `validate_cell` imports the config loader only then.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from atma_titan.utils.errors import InputError
from atma_titan.utils.atomic import write_json_atomic

PLAN_FILE = "sweep.json"
PLAN_VERSION = 3  # 2: absolute base, and the workdir the cells' commands run in; 3: seeds
# Keys the sweep sets itself for every cell: a factor or --set on them would be silently overridden.
RESERVED_KEYS = {
    "job.dump_folder": "each cell trains into <out>/cells/<name>/run",
    "checkpoint.enable": "checkpointing is always on in a sweep, so that a stopped cell resumes",
}
SEED_KEY = "job.seed"  # what --seeds varies: the model's initialisation and the data order


class SweepError(InputError):
    """A bad plan, option or sweep folder: reported as `error: ...` with exit status 2."""


# ---------------------------------------------------------------------------------------------
# Factors, cells, plans


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
    """One run of the sweep (one folder): a factor combination, and with --seeds one of its seeds."""

    index: int
    name: str
    overrides: tuple[tuple[str, str], ...]  # (section.key, value) for each factor, in factor order
    seed: int | None = None  # job.seed of this run (None: the base config's; a plan without --seeds)
    group: str | None = None  # the factor combination's name, shared by its seeds (None: the run's own)

    @property
    def group_name(self) -> str:
        return self.group or self.name

    @property
    def config_overrides(self) -> tuple[tuple[str, str], ...]:
        """What the trainer gets on top of the plan's fixed overrides: the factors, then the seed."""
        return self.overrides if self.seed is None else (*self.overrides, (SEED_KEY, str(self.seed)))

    def to_json(self) -> dict:
        data = {"index": self.index, "name": self.name, "overrides": dict(self.overrides)}
        if self.seed is not None:
            data.update(group=self.group_name, seed=self.seed)
        return data

    @classmethod
    def from_json(cls, data: dict) -> Cell:
        seed = data.get("seed")
        return cls(data["index"], data["name"], tuple(data["overrides"].items()), seed, data.get("group"))


@dataclass
class Plan:
    base: str  # absolute path of the base TOML
    base_sha256: str
    factors: list[Factor]
    fixed: list[tuple[str, str]]
    eval_args: str
    cells: list[Cell]
    skip_invalid: bool = False
    skipped: list[dict] = field(default_factory=list)  # combinations left out by skip_invalid: name, reason
    # Absolute; the cells' commands run here, so relative paths inside the base TOML (data files)
    # resolve as they did when the sweep was planned, whatever directory a later command runs in.
    workdir: str = field(default_factory=os.getcwd)
    seeds: tuple[int, ...] | None = None  # --seeds: every combination once per seed (None: once, as configured)

    @property
    def groups(self) -> dict[str, list[Cell]]:
        """Factor combination's name -> its runs (one per seed), in plan order."""
        out: dict[str, list[Cell]] = {}
        for cell in self.cells:
            out.setdefault(cell.group_name, []).append(cell)
        return out

    def describe_runs(self) -> str:
        """'4 cells' or '4 cells x 3 seeds (0,1,2) = 12 runs'."""
        n = len(self.groups)
        if self.seeds is None:
            return f"{n} cells"
        return f"{n} cells x {len(self.seeds)} seeds ({','.join(map(str, self.seeds))}) = {len(self.cells)} runs"

    def identity(self) -> dict:
        """What makes two plans the same (the cells follow from it; workdir does not count)."""
        return {
            "base": self.base,
            "base_sha256": self.base_sha256,
            "factors": [{"key": f.key, "values": list(f.values)} for f in self.factors],
            "fixed": [f"{k}={v}" for k, v in self.fixed],
            "eval_args": self.eval_args,
            "skip_invalid": self.skip_invalid,
            "seeds": None if self.seeds is None else list(self.seeds),
        }

    def to_json(self) -> dict:
        cells = [c.to_json() for c in self.cells]
        return {
            "version": PLAN_VERSION,
            **self.identity(),
            "workdir": self.workdir,
            "cells": cells,
            "skipped": self.skipped,
        }

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        workdir = data.get("workdir") or os.getcwd()  # version 1 has none: where this command runs
        return cls(
            base=os.path.abspath(os.path.join(workdir, data["base"])),  # version 1: relative to it
            base_sha256=data["base_sha256"],
            factors=[Factor(f["key"], tuple(f["values"])) for f in data["factors"]],
            fixed=[split_assignment(s, "--set") for s in data["fixed"]],
            eval_args=data.get("eval_args", ""),
            cells=[Cell.from_json(c) for c in data["cells"]],
            skip_invalid=data.get("skip_invalid", False),
            skipped=data.get("skipped", []),
            workdir=workdir,
            seeds=None if data.get("seeds") is None else tuple(int(s) for s in data["seeds"]),  # version 2: none
        )


# ---------------------------------------------------------------------------------------------
# Parsing the command line's plan options


def split_assignment(text: str, option: str) -> tuple[str, str]:
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
    key, raw = split_assignment(text, "--factor")
    values = split_values(raw)
    if not raw or any(v == "" for v in values):
        raise SweepError(f"--factor {text!r}: empty value; expected {key}=v1,v2,...")
    return Factor(key, tuple(values))


def parse_seeds(text: str) -> tuple[int, ...]:
    """'0,1,2' or '[0,1,2]' -> (0, 1, 2): distinct non-negative integers, in the order given."""
    seeds = []
    for value in split_values(text):
        if not re.fullmatch(r"\d+", value):
            raise SweepError(f"--seeds {text!r}: {value!r} is not a non-negative integer; expected e.g. --seeds 0,1,2.")
        if int(value) in seeds:
            raise SweepError(f"--seeds {text!r}: seed {int(value)} is given twice.")
        seeds.append(int(value))
    return tuple(seeds)


def parse_plan_options(
    base: str,
    factor_texts: list[str],
    set_texts: list[str],
    eval_args: str = "",
    skip_invalid: bool = False,
    seeds: str | None = None,
) -> Plan:
    """The command line's plan options, parsed (not yet validated against the config). The base
    path is made absolute, and the current directory becomes the plan's workdir."""
    if not factor_texts:
        raise SweepError("a sweep needs at least one --factor section.key=v1,v2,...")
    factors = [parse_factor(t) for t in factor_texts]
    fixed = [split_assignment(t, "--set") for t in set_texts]
    plan = Plan(os.path.abspath(base), "", factors, fixed, eval_args, [], skip_invalid, workdir=os.getcwd())
    return plan if seeds is None else replace(plan, seeds=parse_seeds(seeds))


# ---------------------------------------------------------------------------------------------
# Names


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


# ---------------------------------------------------------------------------------------------
# Building the plan: every cell validated by the project's config loader


def config_argv(base: str, overrides: list[tuple[str, str]]) -> list[str]:
    argv = ["--config", base]
    for key, value in overrides:
        argv += [f"--{key}", value]
    return argv


def validate_cell(base: str, overrides: list[tuple[str, str]]):
    """The cell's resolved config from the project's own loader (raises SweepError with its message)."""
    from atma_titan.config import load_config  # imports torch: only when a plan is built

    try:
        return load_config(config_argv(base, overrides))
    except InputError as e:
        raise SweepError(str(e)) from None


def file_sha256(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as e:
        raise SweepError(f"--base {path}: cannot read it ({e.strerror or e}).") from None


def check_keys(spec: Plan) -> None:
    """Refuse keys the sweep sets itself, keys given twice, and --eval-args that do not split."""
    seen: set[str] = set()
    for option, key in [("--factor", f.key) for f in spec.factors] + [("--set", k) for k, _ in spec.fixed]:
        if key in RESERVED_KEYS:
            raise SweepError(f"{option} {key}: the sweep sets this key itself ({RESERVED_KEYS[key]}).")
        if key in seen:
            raise SweepError(f"{option} {key}: this key is given more than once (as a factor or with --set).")
        if key == SEED_KEY and spec.seeds is not None:
            raise SweepError(f"{option} {key}: --seeds sets {SEED_KEY} of every run; give the seeds with --seeds only.")
        seen.add(key)
    try:
        shlex.split(spec.eval_args)
    except ValueError as e:
        raise SweepError(f"--eval-args {spec.eval_args!r}: {e}") from None


def build_plan(spec: Plan) -> Plan:
    """Validate a plan's options and make its cells; every cell's overrides go through the
    project's load_config before anything runs."""
    check_keys(spec)
    sha = file_sha256(spec.base)
    validate_cell(spec.base, spec.fixed)  # a bad base file or --set: one message, not one per cell
    for seed in spec.seeds or ():  # the seed does not interact with the factors: checked once each
        validate_cell(spec.base, spec.fixed + [(SEED_KEY, str(seed))])
    cells, skipped = make_cells(spec)
    if not cells:
        raise SweepError(f"every combination is invalid; the first: {skipped[0]['reason']}")
    return replace(spec, base_sha256=sha, cells=expand_seeds(cells, spec.seeds), skipped=skipped)


def expand_seeds(cells: list[Cell], seeds: tuple[int, ...] | None) -> list[Cell]:
    """Each combination once per seed (the seed varying fastest), renumbered; unchanged without seeds."""
    if seeds is None:
        return cells
    runs = [(cell, seed) for cell in cells for seed in seeds]
    return [
        Cell(i, f"{cell.name}_seed-{seed}", cell.overrides, seed=seed, group=cell.name)
        for i, (cell, seed) in enumerate(runs)
    ]


def make_cells(spec: Plan) -> tuple[list[Cell], list[dict]]:
    """The product of the factors' values (the first factor slowest), each combination validated;
    an invalid one is an error, or with skip_invalid left out and listed."""
    labels = factor_labels(spec.base, spec.fixed, spec.factors)
    short = short_keys(spec.factors)
    cells, skipped = [], []
    for values in itertools.product(*(f.values for f in spec.factors)):
        overrides = tuple((f.key, v) for f, v in zip(spec.factors, values))
        name = "_".join(f"{safe(short[f.key])}-{labels[f.key][v]}" for f, v in zip(spec.factors, values))
        try:
            validate_cell(spec.base, spec.fixed + list(overrides))  # combinations: e.g. batch_tokens vs seq_len
        except SweepError as e:
            if spec.skip_invalid:  # e.g. the distractor loss exists only with Polar attention
                skipped.append({"name": name, "reason": str(e)})
                continue
            shown = " ".join(f"{k}={v}" for k, v in overrides)
            raise SweepError(
                f"cell {len(cells) + len(skipped)} ({shown}): {e} (--skip-invalid leaves such combinations out)"
            ) from None
        cells.append(Cell(len(cells), name, overrides))
    return cells, skipped


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


def same_file(a: str, b: str) -> bool:
    """Two spellings of one path (a symlink, `..`): the same base, from whichever directory it was given."""
    return os.path.realpath(a) == os.path.realpath(b)


def plan_differences(saved: Plan, new: Plan) -> list[str]:
    old_id, new_id = saved.identity(), new.identity()
    same_base = same_file(saved.base, new.base)
    diffs = []
    for key in old_id:
        if key == "base_sha256":
            if same_base and old_id[key] != new_id[key]:  # another base file: the "base" line says so
                diffs.append(f"the base file {new.base} has changed since the plan was written")
            continue
        differs = not same_base if key == "base" else old_id[key] != new_id[key]
        if differs:
            diffs.append(f"{key}: saved {json.dumps(old_id[key])}, now {json.dumps(new_id[key])}")
    return diffs


def check_plan(out: Path, plan: Plan, force: bool) -> Plan:
    """`plan`, refused if <out>/sweep.json holds a different one (unless `force`). A matching saved
    plan lends it its workdir, so that every command of one sweep runs the cells in the same place."""
    saved = read_plan(out) if not force else None
    if saved is None:
        return plan
    diffs = plan_differences(saved, plan)
    if diffs:
        raise SweepError(
            f"{plan_path(out)} holds a different plan:\n  - "
            + "\n  - ".join(diffs)
            + "\nUse another --out, or --force-plan to replace the plan (cells with the same name keep "
            "their folders and results)."
        )
    return replace(plan, workdir=saved.workdir)


def save_plan(out: Path, plan: Plan, force: bool) -> Plan:
    """check_plan, then write sweep.json if there is none (or `force`). Returns the plan to run."""
    plan = check_plan(out, plan, force)
    out.mkdir(parents=True, exist_ok=True)
    if force or not plan_path(out).is_file():
        write_json_atomic(plan_path(out), plan.to_json())
    return plan
