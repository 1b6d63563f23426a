"""Checkpoints over torch.distributed.checkpoint (DCP): save, resume, retention, weight export.

Layout on disk, one directory per saved step under the checkpoint folder:

    <folder>/
      step-500/
        .metadata, __0_0.distcp, __1_0.distcp, ...   DCP files: every rank writes its own shards
        rank_state/rank-0.pt, rank-1.pt, ...         torch.save of each rank's private state
        COMPLETE                                      {"step", "world_size", "time", "torch"} as JSON
      step-1000/
        ...

What goes through DCP is the global state, passed as a dict of Stateful objects or plain
dicts/tensors: the model under the top-level key "model" (wrap it with `model_state`, so FSDP2
DTensor shards are saved by rank and `load_model_only` can read the weights alone), the optimizers
(`optimizer_state`), the LR schedulers and a small train state such as {"step", "tokens",
"windows"}. DCP stores every tensor by its fully qualified name and global shape, so a checkpoint
written by N ranks loads at M ranks, or into an unsharded model in one process without
torch.distributed. Per-rank state (data-loader position, RNG states) differs between ranks and
must not be merged by DCP's deduplication, so each rank torch.saves its own file beside the DCP
files; it is returned by `load` only when the world size is unchanged, otherwise the caller
rebuilds it from the global train state.

Completeness rule: a step directory is a checkpoint only once it holds COMPLETE. Rank 0 writes
that marker (to a temporary name, then os.replace, so it appears whole or not at all) after a
barrier that every rank reaches only when its DCP shards and its rank file are on disk. A crash
mid-save therefore leaves a directory without a marker, which `latest_step` and `load` never
choose and retention later deletes. Retention (keep_latest_k > 0) removes complete checkpoints
beyond the newest k and any unmarked directory older than the newest complete one; removal takes
the marker away first, so a half-deleted directory is never mistaken for a checkpoint.

With async_save=True the DCP write runs in a background thread (dcp.async_save, which first
copies the state to CPU memory, so training may go on changing it) over a dedicated gloo process
group; the marker and retention for that checkpoint happen at the next save(), wait() or close().
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from atma_titan.run_folder import COMPLETE_NAME, complete_steps, is_complete, latest_complete_step, step_dir, step_dirs

MODEL_KEY = "model"
RANK_STATE_DIR = "rank_state"

__all__ = [
    "CheckpointManager",
    "ModelState",
    "OptimizerState",
    "export_safetensors",
    "load_model_only",
    "load_safetensors",
    "model_state",
    "optimizer_state",
]


# ---------------------------------------------------------------------------------------------
# Stateful wrappers for the model and the optimizers
# ---------------------------------------------------------------------------------------------


class ModelState(Stateful):
    """The model as DCP sees it: FQN -> tensor (DTensor shards under FSDP2).

    get/set_model_state_dict strip wrapper prefixes (`_orig_mod.` from torch.compile,
    `_checkpoint_wrapped_module.` from activation checkpointing), so names match between a
    compiled FSDP2 model and a plain one.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """Several optimizers over one model, as one state dict keyed by parameter FQN.

    The flattened form ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr") ties every value to a
    parameter name rather than to a group index, so it survives resharding and a different split of
    parameters between optimizers. Optimizers that have not stepped yet get their state created
    (a step with zero gradients and lr 0) so there are tensors to load into.
    """

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizers: Any):
        self.model = model
        self.optimizers = _optimizer_list(optimizers)

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizers, options=self._OPTIONS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizers, state_dict, options=self._OPTIONS)


def model_state(model: nn.Module) -> ModelState:
    """Stateful view of `model` for the "model" key of a checkpoint state."""
    return ModelState(model)


def optimizer_state(model: nn.Module, optimizers: Any) -> OptimizerState:
    """Stateful view of `optimizers`: one torch optimizer, a list of them, or a container with `.optimizers`."""
    return OptimizerState(model, optimizers)


def _optimizer_list(optimizers: Any) -> list[torch.optim.Optimizer]:
    optimizers = getattr(optimizers, "optimizers", optimizers)  # atma_titan.optim.Optimizers
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    optimizers = list(optimizers)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError(f"expected torch optimizers, got {optimizers!r}")
    return optimizers


# ---------------------------------------------------------------------------------------------
# Small filesystem and process-group helpers
# ---------------------------------------------------------------------------------------------


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _global_rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _read_marker(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / COMPLETE_NAME).read_text())


def _write_marker(ckpt: Path, step: int, world_size: int) -> None:
    """Write COMPLETE atomically: a reader sees the whole file or none."""
    tmp = ckpt / f".{COMPLETE_NAME}.tmp"
    info = {"step": step, "world_size": world_size, "time": time.time(), "torch": torch.__version__}
    with open(tmp, "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / COMPLETE_NAME)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _remove_checkpoint(ckpt: Path) -> None:
    # The marker goes first: if we die halfway, what is left no longer counts as a checkpoint.
    (ckpt / COMPLETE_NAME).unlink(missing_ok=True)
    shutil.rmtree(ckpt, ignore_errors=True)


def _upload_future(result: Any) -> Any:
    """dcp.async_save returns a Future, or (newer staging paths) an AsyncSaveResponse holding one."""
    return getattr(result, "upload_completion", result)


# ---------------------------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------------------------


class CheckpointManager:
    """Saves and loads step-<n> checkpoints under `folder`; see the module docstring for the layout.

    Construct it, save and load on every rank: all three are collective when torch.distributed
    is initialised. `rank` and `world_size` default to those of the default process group (or 0
    and 1 without one); given explicitly, they must agree with it. `on_saved(step, directory,
    seconds)` is called on rank 0 once a checkpoint is complete (seconds since its save began).
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        keep_latest_k: int = 0,
        async_save: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        on_saved: Callable[[int, Path, float], None] | None = None,
    ):
        if keep_latest_k < 0:
            raise ValueError(f"keep_latest_k = {keep_latest_k} is invalid; allowed: 0 (keep all) or a positive count")
        self.folder = Path(folder)
        self.keep_latest_k = keep_latest_k
        self.async_save = async_save
        self.rank, self.world_size = _resolve_rank(rank, world_size)
        # A gloo group of our own: an async save runs its collectives in a background thread, which
        # must never share a group with the training loop's collectives, and async_save needs a CPU
        # backend anyway. Barriers and small object broadcasts use it too, keeping them off NCCL.
        self._group = dist.new_group(backend="gloo") if _dist_on() else None
        self.on_saved = on_saved
        self._pending: tuple[int, Any] | None = None  # (step, future) of an in-flight async save
        self._save_began = 0.0
        self._closed = False
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
        self._barrier()

    # -- queries --------------------------------------------------------------------------------

    def checkpoint_dir(self, step: int) -> Path:
        return step_dir(self.folder, step)

    def latest_step(self) -> int | None:
        """Newest step with a COMPLETE marker under the folder, or None. Reads the filesystem locally."""
        return latest_complete_step(self.folder)

    def saved_world_size(self, step: int) -> int:
        ckpt = self.checkpoint_dir(step)
        if not is_complete(ckpt):
            raise FileNotFoundError(self._not_found(ckpt))
        return int(_read_marker(ckpt)["world_size"])

    # -- save -----------------------------------------------------------------------------------

    @torch.no_grad()
    def save(self, step: int, state: dict[str, Any], rank_state: dict[str, Any] | None = None) -> None:
        """Write `state` through DCP and `rank_state` to this rank's own file, as step-<step>.

        Synchronous: returns when the checkpoint is complete (marker written, retention done).
        Asynchronous: returns once the state is copied to CPU memory; it completes at the next
        save(), wait() or close().
        """
        self._check_open()
        self.wait()  # one checkpoint in flight at a time
        if MODEL_KEY not in state:
            warnings.warn(
                f"checkpoint state has no {MODEL_KEY!r} key; load_model_only will not find weights in it", stacklevel=2
            )
        ckpt = self.checkpoint_dir(step)
        self._save_began = time.perf_counter()
        if self.rank == 0:
            self._fresh_dir(ckpt)
        self._barrier()  # the directory exists before any rank writes into it
        if rank_state is not None:
            _atomic_torch_save(rank_state, ckpt / RANK_STATE_DIR / f"rank-{self.rank}.pt")
        if self.async_save:
            result = dcp.async_save(state, checkpoint_id=str(ckpt), process_group=self._group)
            self._pending = (step, _upload_future(result))
        else:
            dcp.save(state, checkpoint_id=str(ckpt), process_group=self._group)
            self._finish(step)

    def wait(self) -> None:
        """Finish the in-flight async save, if any: wait for its writes, then marker and retention."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        future.result()  # re-raises the background save's error; the directory then stays unmarked
        self._finish(step)

    def close(self) -> None:
        """Finish any async save. Call it on every rank before exit, or the last async save never counts."""
        if not self._closed:
            self.wait()
            self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- load -----------------------------------------------------------------------------------

    @torch.no_grad()
    def load(
        self, state: dict[str, Any], *, step: int | None = None, path: str | Path | None = None
    ) -> dict[str, Any] | None:
        """Load a complete checkpoint into `state` in place (latest one unless `step` or `path`).

        Stateful values get load_state_dict; plain values are replaced in `state`, so read them
        back from it. Returns this rank's rank_state when the checkpoint was saved at the current
        world size and holds a file for this rank, else None.
        """
        self.wait()  # never read a checkpoint that is still being written
        ckpt, saved_world_size = self._resolve(step, path)
        dcp.load(state, checkpoint_id=str(ckpt), process_group=self._group)
        if saved_world_size != self.world_size:
            return None
        own = ckpt / RANK_STATE_DIR / f"rank-{self.rank}.pt"
        # Our own file, holding RNG tuples and numpy arrays: not loadable with weights_only.
        return torch.load(own, weights_only=False) if own.is_file() else None

    # -- internals ------------------------------------------------------------------------------

    def _finish(self, step: int) -> None:
        self._barrier()  # every rank's shards and rank file are on disk
        ckpt = self.checkpoint_dir(step)
        if self.rank == 0:
            _write_marker(ckpt, step, self.world_size)
        self._barrier()  # every rank may now treat the checkpoint as complete
        if self.rank == 0 and self.keep_latest_k > 0:
            self._apply_retention(just_saved=step)
        if self.rank == 0 and self.on_saved is not None:
            self.on_saved(step, ckpt, time.perf_counter() - self._save_began)

    def _fresh_dir(self, ckpt: Path) -> None:
        """Empty step directory with its rank_state subdirectory (rank 0 only)."""
        if ckpt.exists():
            if is_complete(ckpt):
                warnings.warn(f"overwriting the complete checkpoint {ckpt}", stacklevel=3)
            _remove_checkpoint(ckpt)  # leftovers of a crashed save, or a repeated step
        (ckpt / RANK_STATE_DIR).mkdir(parents=True, exist_ok=True)

    def _apply_retention(self, just_saved: int) -> None:
        complete = complete_steps(self.folder)
        keep = set(complete[-self.keep_latest_k :]) | {just_saved}
        newest = complete[-1] if complete else -1
        for step, ckpt in step_dirs(self.folder):
            if step in keep:
                continue
            if is_complete(ckpt) or step < newest:
                _remove_checkpoint(ckpt)

    def _resolve(self, step: int | None, path: str | Path | None) -> tuple[Path, int]:
        """(checkpoint dir, saved world size), decided by rank 0 so every rank reads the same one."""
        if step is not None and path is not None:
            raise ValueError("pass step or path to load(), not both")
        answer: tuple[str, int] | str = ""
        if self.rank == 0:
            try:
                ckpt = self._pick(step, path)
                answer = (str(ckpt), int(_read_marker(ckpt)["world_size"]))
            except FileNotFoundError as e:
                answer = str(e)
            except (ValueError, KeyError) as e:  # a marker that is not our JSON
                answer = f"unreadable {COMPLETE_NAME} marker under {self.folder}: {e!r}"
        answer = self._broadcast(answer)
        if isinstance(answer, str):  # every rank raises, so none waits forever in dcp.load
            raise FileNotFoundError(answer)
        return Path(answer[0]), answer[1]

    def _pick(self, step: int | None, path: str | Path | None) -> Path:
        if path is not None:
            ckpt = Path(path)
        elif step is not None:
            ckpt = self.checkpoint_dir(step)
        else:
            latest = self.latest_step()
            if latest is None:
                raise FileNotFoundError(f"no complete checkpoint (step-<n>/{COMPLETE_NAME}) under {self.folder}")
            ckpt = self.checkpoint_dir(latest)
        if not is_complete(ckpt):
            raise FileNotFoundError(self._not_found(ckpt))
        return ckpt

    def _not_found(self, ckpt: Path) -> str:
        have = complete_steps(self.folder)
        state = "does not exist" if not ckpt.exists() else f"has no {COMPLETE_NAME} marker (an unfinished save)"
        return (
            f"checkpoint {ckpt} {state}; complete checkpoints under {self.folder}: "
            f"{', '.join(step_dir(self.folder, s).name for s in have) if have else 'none'}"
        )

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def _broadcast(self, obj: Any) -> Any:
        if self._group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager for {self.folder} is closed")


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if _dist_on():
        actual = (dist.get_rank(), dist.get_world_size())
        if (rank is not None and rank != actual[0]) or (world_size is not None and world_size != actual[1]):
            raise ValueError(
                f"CheckpointManager got rank={rank}, world_size={world_size} but the default process "
                f"group has rank={actual[0]}, world_size={actual[1]}; leave them unset to use it"
            )
        return actual
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is invalid for world_size={world_size}")
    return rank, world_size


# ---------------------------------------------------------------------------------------------
# Weights only: DCP model load, safetensors export and import
# ---------------------------------------------------------------------------------------------


def _weights_dir(path_or_dir: str | Path) -> Path:
    """A complete step directory, or the newest complete one under a checkpoint folder."""
    path = Path(path_or_dir)
    if is_complete(path):
        return path
    steps = complete_steps(path)
    if steps:
        return step_dir(path, steps[-1])
    raise FileNotFoundError(f"{path} is neither a complete checkpoint (with {COMPLETE_NAME}) nor a folder holding one")


@torch.no_grad()
def load_model_only(model: nn.Module, path_or_dir: str | Path) -> Path:
    """Load just the weights of a checkpoint into `model` (sharded or not); returns the dir read.

    `path_or_dir` is a step directory or a checkpoint folder (then its newest complete step).
    Optimizer and other state in the checkpoint are not read. Collective under torch.distributed.
    """
    ckpt = _weights_dir(path_or_dir)
    dcp.load({MODEL_KEY: ModelState(model)}, checkpoint_id=str(ckpt))
    return ckpt


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights, views): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        t = t.detach().cpu().contiguous()
        storage = t.untyped_storage().data_ptr()
        out[name] = t.clone() if storage in seen else t
        seen.add(storage)
    return out


@torch.no_grad()
def export_safetensors(model: nn.Module, path: str | Path, *, dtype: torch.dtype | None = None) -> Path | None:
    """Write the full (unsharded) weights to one .safetensors file from rank 0.

    Collective under FSDP2 (every rank takes part in gathering the shards); only rank 0 writes,
    and returns the path (other ranks get None). `dtype` casts floating-point tensors, e.g. to bf16.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _global_rank() != 0:
        return None
    if dtype is not None:
        full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(_unshared(full), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | Path, *, strict: bool = True) -> None:
    """Load a .safetensors file of full weights into `model` (names as written by export_safetensors).

    Meant for one device; under FSDP2 every rank reads the whole file and keeps its shards.
    """
    full = load_file(str(path))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=strict))
