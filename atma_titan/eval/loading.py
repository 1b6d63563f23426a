"""Find a checkpoint and its run config, and load the model for evaluation (one device, unsharded).

A checkpoint path may be:

* a DCP step directory `<run>/checkpoints/step-N/` (complete: it holds COMPLETE);
* a checkpoint folder `<run>/checkpoints/`: its newest complete step, or step N with `step=N`;
* a run's dump folder `<run>/`: its checkpoint folder (`[checkpoint] folder` of its config.toml),
  or, when that holds no complete step, its exported `model.safetensors`;
* an exported `.safetensors` file (`[checkpoint] export_safetensors = true` writes
  `<run>/model.safetensors`); its step is read from the run's DONE marker when there is one.

The run config is `<run>/config.toml` (the trainer writes the resolved config there); the model is
built from its `[model]` section (flavor and overrides), so an ablation cell is evaluated with the
architecture it was trained with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from atma_titan.checkpoint import MARKER, load_model_only, load_safetensors
from atma_titan.config import JobConfig, load_config
from atma_titan.eval.common import EvalInputError
from atma_titan.models import ATMA, resolve_model_args

__all__ = ["ResolvedCheckpoint", "load_eval_model", "pick_eval_device", "resolve_checkpoint"]

_STEP_DIR = re.compile(r"^step-(\d+)$")
CONFIG_NAME = "config.toml"
SAFETENSORS_NAME = "model.safetensors"
DONE_NAME = "DONE"


@dataclass
class ResolvedCheckpoint:
    path: Path  # the step directory or .safetensors file to read
    kind: str  # "dcp" | "safetensors"
    step: int | None
    run_dir: Path  # the run's dump folder (default home of config.toml and eval/)
    config: Path | None  # the run's config.toml, if found


def _complete_steps(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    steps = []
    for child in folder.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def _step_of(step_dir: Path) -> int | None:
    match = _STEP_DIR.match(step_dir.name)
    return int(match.group(1)) if match else None


def _config_near(*dirs: Path) -> Path | None:
    for d in dirs:
        if (d / CONFIG_NAME).is_file():
            return d / CONFIG_NAME
    return None


def _done_step(run_dir: Path) -> int | None:
    try:
        return int((run_dir / DONE_NAME).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _checkpoint_folder_name(config: Path | None) -> str:
    if config is None:
        return "checkpoints"
    try:
        return tomllib.loads(config.read_text()).get("checkpoint", {}).get("folder", "checkpoints")
    except (OSError, tomllib.TOMLDecodeError):
        return "checkpoints"


def _from_folder(folder: Path, step: int | None, run_dir: Path, config: Path | None) -> ResolvedCheckpoint:
    steps = _complete_steps(folder)
    have = ", ".join(f"step-{s}" for s in steps) or "none"
    if step is None:
        if not steps:
            raise EvalInputError(f"no complete checkpoint (step-<n>/{MARKER}) under {folder}")
        step = steps[-1]
    elif step not in steps:
        raise EvalInputError(f"no complete checkpoint step-{step} under {folder}; complete checkpoints: {have}")
    return ResolvedCheckpoint(folder / f"step-{step}", "dcp", step, run_dir, config)


def resolve_checkpoint(path: str | Path, step: int | None = None) -> ResolvedCheckpoint:
    """Which weights `path` names (see the module docstring); raises EvalInputError when there are none."""
    path = Path(path).expanduser()
    if not path.exists():
        raise EvalInputError(f"checkpoint {path} does not exist")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise EvalInputError(f"{path} is a file but not a .safetensors export; pass a checkpoint directory")
        run = path.parent
        return ResolvedCheckpoint(
            path, "safetensors", step if step is not None else _done_step(run), run, _config_near(run)
        )
    if (path / MARKER).is_file():  # a step directory
        own = _step_of(path)
        if step is not None and own is not None and step != own:
            raise EvalInputError(f"--step {step} does not match the checkpoint directory {path}")
        run = path.parent.parent
        return ResolvedCheckpoint(path, "dcp", own if own is not None else step, run, _config_near(run, path.parent))
    if any(_STEP_DIR.match(c.name) for c in path.iterdir()):  # a checkpoint folder
        return _from_folder(path, step, path.parent, _config_near(path.parent, path))
    config = _config_near(path)  # a dump folder
    folder = path / _checkpoint_folder_name(config)
    if _complete_steps(folder) or step is not None:
        return _from_folder(folder, step, path, config)
    if (path / SAFETENSORS_NAME).is_file():
        return ResolvedCheckpoint(path / SAFETENSORS_NAME, "safetensors", _done_step(path), path, config)
    raise EvalInputError(
        f"{path} holds no checkpoint: no complete step-<n>/{MARKER} under {folder} and no {SAFETENSORS_NAME}"
    )


def load_run_config(resolved: ResolvedCheckpoint, config: str | Path | None = None) -> JobConfig:
    """`config` if given, else the run's config.toml next to the checkpoint."""
    path = Path(config) if config else resolved.config
    if path is None:
        raise EvalInputError(
            f"no {CONFIG_NAME} found for {resolved.path} (looked in {resolved.run_dir}); pass --config FILE.toml "
            "(the config the run was trained with)"
        )
    return load_config(["--config", str(path)])


def pick_eval_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EvalInputError(f"--device {name}: no CUDA device is available; use auto or cpu")
    return device


def load_eval_model(cfg: JobConfig, resolved: ResolvedCheckpoint, device: torch.device) -> ATMA:
    """Build the run's model unsharded on `device` and load the checkpoint's weights into it."""
    with torch.device("meta"):
        model = ATMA(resolve_model_args(cfg.model))
    model.to_empty(device=device)  # every tensor is then overwritten by the load (strict)
    if resolved.kind == "safetensors":
        load_safetensors(model, resolved.path)
    else:
        load_model_only(model, resolved.path)
    return model.eval()
