"""Find a checkpoint and its run config, and load the model for evaluation (one device, unsharded).

A checkpoint path may be:

* a DCP step directory `<run>/checkpoints/step-N/` (complete: it holds COMPLETE);
* a checkpoint folder `<run>/checkpoints/`: its newest complete step, or step N with `step=N`;
* a run's dump folder `<run>/`: its checkpoint folder (`[checkpoint] folder` of its config.toml),
  or, when that holds no complete step, its exported `model.safetensors`;
* an exported `.safetensors` file (`[checkpoint] export_safetensors = true` writes
  `<run>/model.safetensors`); its step is read from the run's DONE marker when there is one;
* an exported Hugging Face folder (`python -m atma_titan.export`, `[checkpoint] export_hf = true`):
  its training_config.toml is the run config, its config.json must describe the same model.

A DCP checkpoint is verified against the manifest in its COMPLETE marker before its weights load,
and nothing in it or in a .safetensors file runs code when read (see atma_titan.checkpoint.manager); a
damaged or unreadable one is an InputError naming the file (the commands exit 2), with the other
complete steps the folder holds for `--step`.

The run config is `<run>/config.toml` (the trainer writes the resolved config there); the model is
built from its `[model]` section (flavor and overrides), so an ablation cell is evaluated with the
architecture it was trained with.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from atma_titan.checkpoint.manager import checkpoint_problems, load_model_only
from atma_titan.checkpoint.weights import load_safetensors
from atma_titan.config import JobConfig, load_config
from atma_titan.data import check_vocab
from atma_titan.data.tokenizer import available_tokenizers, build_tokenizer
from atma_titan.checkpoint.errors import CheckpointError
from atma_titan.hf.load import RUN_CONFIG, check_same_model, hf_step, is_hf_folder, load_hf_weights, read_hf_model_args
from atma_titan.models import ATMA, ModelArgs, build_model, resolve_model_args
from atma_titan.run.folder import (
    COMPLETE_NAME,
    CONFIG_NAME,
    RunFolder,
    complete_steps,
    is_complete,
    step_dir,
    step_dirs,
    step_of,
)

__all__ = [
    "OpenCheckpoint",
    "ResolvedCheckpoint",
    "load_eval_model",
    "load_run_config",
    "open_checkpoint",
    "resolve_checkpoint",
]


@dataclass
class ResolvedCheckpoint:
    path: Path  # the step directory or .safetensors file to read
    kind: str  # "dcp" | "safetensors" | "hf"
    step: int | None
    run_dir: Path  # the run's dump folder (default home of config.toml and eval/)
    config: Path | None  # the run's config.toml, if found
    verified: bool = False  # checked against its manifest while resolving: the load need not hash it again


def _config_near(*dirs: Path) -> Path | None:
    for d in dirs:
        if (d / CONFIG_NAME).is_file():
            return d / CONFIG_NAME
    return None


def _from_folder(folder: Path, step: int | None, run_dir: Path, config: Path | None) -> ResolvedCheckpoint:
    steps = complete_steps(folder)
    have = ", ".join(step_dir(folder, s).name for s in steps) or "none"
    if step is None:
        if not steps:
            raise CheckpointError(f"no complete checkpoint (step-<n>/{COMPLETE_NAME}) under {folder}")
        ckpt = _newest_sound(folder, steps)
        return ResolvedCheckpoint(ckpt, "dcp", step_of(ckpt), run_dir, config, verified=True)
    if step not in steps:
        raise CheckpointError(
            f"no complete checkpoint {step_dir(folder, step).name} under {folder}; complete checkpoints: {have}"
        )
    return ResolvedCheckpoint(step_dir(folder, step), "dcp", step, run_dir, config)


def _newest_sound(folder: Path, steps: list[int]) -> Path:
    """The newest step directory that verifies; a damaged one is skipped with a warning, as training does."""
    skipped = []
    for ckpt in (step_dir(folder, s) for s in reversed(steps)):
        problems = checkpoint_problems(ckpt)
        if not problems:
            if skipped:
                print(
                    f"warning: skipped the damaged {' and '.join(skipped)}; using {ckpt.name} (--step N chooses "
                    "another)",
                    file=sys.stderr,
                    flush=True,
                )
            return ckpt
        skipped.append(f"{ckpt.name} ({'; '.join(problems)})")  # newest first
    raise CheckpointError(f"no checkpoint under {folder} verifies: {' | '.join(skipped)}")


def resolve_checkpoint(path: str | Path, step: int | None = None) -> ResolvedCheckpoint:
    """Which weights `path` names (see the module docstring); raises CheckpointError when there are none."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is a file but not a .safetensors export; pass a checkpoint directory")
        run = RunFolder.of(path.parent)
        return ResolvedCheckpoint(
            path, "safetensors", step if step is not None else run.done_step(), run.path, _config_near(run.path)
        )
    if is_hf_folder(path):  # an exported Hugging Face folder (python -m atma_titan.export, checkpoint.export_hf)
        config = path / RUN_CONFIG if (path / RUN_CONFIG).is_file() else None
        return ResolvedCheckpoint(path, "hf", hf_step(path) if step is None else step, path, config)
    if is_complete(path):  # a step directory
        own = step_of(path)
        if step is not None and own is not None and step != own:
            raise CheckpointError(f"--step {step} does not match the checkpoint directory {path}")
        run = path.parent.parent
        return ResolvedCheckpoint(path, "dcp", own if own is not None else step, run, _config_near(run, path.parent))
    if step_dirs(path):  # a checkpoint folder
        return _from_folder(path, step, path.parent, _config_near(path.parent, path))
    run = RunFolder.of(path)  # a dump folder
    config = _config_near(path)
    if complete_steps(run.checkpoints) or step is not None:
        return _from_folder(run.checkpoints, step, path, config)
    if run.safetensors.is_file():
        return ResolvedCheckpoint(run.safetensors, "safetensors", run.done_step(), path, config)
    raise CheckpointError(_no_weights_message(run))


def _no_weights_message(run: RunFolder) -> str:
    """What the folder lacks, and what to change in the training command to get it."""
    message = (
        f"{run.path} holds no checkpoint: no complete step-<n>/{COMPLETE_NAME} under {run.checkpoints} "
        f"and no {run.safetensors.name}"
    )
    if run.config.is_file() or run.done.is_file():
        message += (
            "; it looks like a run trained with checkpoint.enable = false: train it again with "
            "--checkpoint.enable true (a checkpoint at the end) or --checkpoint.export_safetensors true"
        )
    return message


def load_run_config(resolved: ResolvedCheckpoint, config: str | Path | None = None) -> JobConfig:
    """`config` if given, else the run's config.toml next to the checkpoint."""
    path = Path(config) if config else resolved.config
    if path is None:
        raise CheckpointError(
            f"no {CONFIG_NAME} found for {resolved.path} (looked in {resolved.run_dir}); pass --config FILE.toml "
            "(the config the run was trained with)"
        )
    return load_config(["--config", str(path)])


def load_eval_model(args: ModelArgs, resolved: ResolvedCheckpoint, device: torch.device) -> ATMA:
    """Build the model `args` describes unsharded on `device` and load the checkpoint's weights into it."""
    model = build_model(args, device)  # every tensor is then overwritten (strict load)
    if resolved.kind == "hf":
        load_hf_weights(model, resolved.path)
    elif resolved.kind == "safetensors":
        load_safetensors(model, resolved.path)
    else:
        load_model_only(model, resolved.path, verified=resolved.verified)
    return model.eval()


@dataclass
class OpenCheckpoint:
    """A checkpoint and what its run says about it: the config, the model's shape and the tokenizer."""

    resolved: ResolvedCheckpoint
    cfg: JobConfig
    model_args: ModelArgs
    tokenizer: object  # None when opened without it


def open_checkpoint(
    path: str | Path, step: int | None = None, config: str | Path | None = None, *, with_tokenizer: bool = True
) -> OpenCheckpoint:
    """Resolve `path`, read its run config, and build and check its tokenizer (unless `with_tokenizer` is False:
    the export builds its own and exports without it when it cannot); loads no weights."""
    resolved = resolve_checkpoint(path, step)
    cfg = load_run_config(resolved, config)
    model_args = resolve_model_args(cfg.model)
    if resolved.kind == "hf":  # its config.json is the model; its tokenizer.json, for a Hugging Face tokenizer
        check_same_model(model_args, read_hf_model_args(resolved.path), resolved.path, f"{resolved.config}")
        if (resolved.path / "tokenizer.json").is_file() and cfg.data.tokenizer not in available_tokenizers():
            cfg.data.tokenizer = str(resolved.path)  # byte and gpt2 are built by name: the run's own decode
    if not with_tokenizer:
        return OpenCheckpoint(resolved, cfg, model_args, None)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    check_vocab(cfg.data.tokenizer, tokenizer.vocab_size, model_args.vocab_size)
    return OpenCheckpoint(resolved, cfg, model_args, tokenizer)
