"""Checkpoints over torch.distributed.checkpoint (DCP): save, verify, resume, retention, loading the weights alone.

Layout on disk, one directory per saved step under the checkpoint folder:

    <folder>/
      step-500/
        .metadata, __0_0.distcp, __1_0.distcp, ...   DCP files: every rank writes its own shards
        rank_state/rank-0.pt, rank-1.pt, ...         each rank's private state (weights_only-loadable)
        COMPLETE                                      JSON: step, world size, and the manifest: every
                                                      file's size and xxh3_64 (manifest.py)
      step-1000/
        ...
      rolled_back/<time>/step-N/                     checkpoints set aside by a load_step rollback

What goes through DCP is the global state, passed as a dict of Stateful objects or plain
dicts/tensors: the model under the top-level key "model" (wrap it with `model_state`, so FSDP2
DTensor shards are saved by rank and `load_model_only` can read the weights alone), the optimizers
(`optimizer_state`), the LR schedulers and a small train state such as {"step", "tokens",
"windows"}. DCP stores every tensor by its fully qualified name and global shape, so a checkpoint
written by N ranks loads at M ranks, or into an unsharded model in one process without
torch.distributed. Per-rank state (data-loader position, RNG states) differs between ranks and
must not be merged by DCP's deduplication, so each rank saves its own file beside the DCP files;
it must hold only what torch.load(weights_only=True) accepts (tensors, plain containers, numbers,
strings, bytes, None: `save` refuses anything else), and it is returned by `load` only when the
world size is unchanged, otherwise the caller rebuilds it from the global train state.

Completeness rule: a step directory is a checkpoint only once it holds COMPLETE. Each rank hashes
the files it wrote (its __<rank>_*.distcp files and its rank file; rank 0 also .metadata), the
digests are gathered, and rank 0 writes the marker with the manifest (atomically and durably,
utils/atomic.py: it appears whole or not at all, and survives a crash of the host). A crash mid-save
therefore leaves a directory without a marker, which `latest_step` and `load` never choose and
retention later deletes.

Verification: before loading, the chosen checkpoint is checked against its manifest, file i by
rank i % world_size (size, digest; .metadata and rank files must also unpickle through the
allowlists of safe_unpickle.py), and the verdicts are gathered so every rank agrees. A checkpoint
that fails is skipped with a CheckpointWarning naming the step, the file and what is wrong, and
the newest older one that verifies is loaded; it stays on disk. None verifying, or a failure inside
dcp.load itself, is a CheckpointError (an InputError: exit 2) on every rank, naming the steps and
files. Checkpoints written before manifests existed load unverified, with a warning.

Nothing in a checkpoint runs code when loaded: .metadata is unpickled through an allowlist of DCP's
metadata types, DCP's non-tensor values and the rank files load with weights_only=True.

Retention (keep_latest_k > 0), after each save: of the checkpoints at or below the step just saved,
the newest k complete ones stay and the rest go, with any unmarked directory among them; those
newer than the step just saved (a damaged newest one that was skipped at resume) are left alone
and do not count, so they never push out the verified checkpoint the run resumed from. Removal
takes the marker away first, so a half-deleted directory is never mistaken for a checkpoint.

With async_save=True the DCP write runs in a background thread (dcp.async_save, which first
copies the state to CPU memory, so training may go on changing it) over a dedicated gloo process
group, followed in another thread by this rank's hashing; `poll()`, called every step, finishes the
checkpoint (manifest, marker, retention, on_saved) as soon as every rank's write and hashing are
done. The next save(), wait() or close() finishes it at the latest.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from atma_titan.checkpoint.errors import CheckpointError, CheckpointNotFoundError, UnsafeCheckpointError
from atma_titan.checkpoint.manifest import (
    FileEntry,
    Marker,
    MarkerError,
    files_on_disk,
    hash_file,
    read_marker,
    write_marker,
)
from atma_titan.checkpoint.verify import RANK_STATE_DIR, local_problems, rank_file
from atma_titan.run.folder import (
    COMPLETE_NAME,
    RunFolder,
    complete_steps,
    is_complete,
    latest_complete_step,
    step_dir,
    step_dirs,
    step_of,
)
from atma_titan.checkpoint.safe_unpickle import (
    METADATA_NAME,
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_rank_file,
    safe_bytes,
    short_reason,
)
from atma_titan.utils.atomic import write_bytes_atomic

MODEL_KEY = "model"
ROLLED_BACK_DIR = "rolled_back"
DAMAGED_SUFFIX = ".damaged"  # step-N.damaged: a checkpoint that failed verification, set aside by a resume

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointWarning",
    "Chosen",
    "ModelState",
    "OptimizerState",
    "UnsafeCheckpointError",
    "load_model_only",
    "model_state",
    "optimizer_state",
]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (it failed verification) or is loaded unverified."""


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


def _remove_checkpoint(ckpt: Path) -> None:
    # The marker goes first: if we die halfway, what is left no longer counts as a checkpoint.
    (ckpt / COMPLETE_NAME).unlink(missing_ok=True)
    shutil.rmtree(ckpt, ignore_errors=True)


def _upload_future(result: Any) -> Any:
    """dcp.async_save returns a Future, or (newer staging paths) an AsyncSaveResponse holding one."""
    return getattr(result, "upload_completion", result)


def _own_files(ckpt: Path, rank: int) -> list[str]:
    """The files `rank` wrote into `ckpt`: DCP names each rank's data __<rank>_<n>.distcp."""
    names = [p.name for p in ckpt.glob(f"__{rank}_*.distcp")]
    if (ckpt / rank_file(rank)).is_file():
        names.append(rank_file(rank))
    if rank == 0:
        names.append(METADATA_NAME)
    return sorted(names)


def _hash_files(ckpt: Path, names: list[str]) -> dict[str, FileEntry]:
    return {name: hash_file(ckpt / name) for name in names}


def _load_failure(error: BaseException) -> str:
    """One line per failing rank for an error out of dcp.load (CheckpointException wraps each rank's)."""
    if isinstance(error, CheckpointException):
        parts = []
        for rank, (exc, _trace) in sorted(error.failures.items()):
            parts.append(f"rank {rank}: {exc if isinstance(exc, CheckpointError) else short_reason(exc)}")
        return "; ".join(parts)
    return str(error) if isinstance(error, CheckpointError) else short_reason(error)


def model_mismatch(ckpt: Path, model: ModelState) -> str | None:
    """What differs between the parameters a checkpoint holds and the model's, or None when they match.

    DCP's planner refuses a parameter the checkpoint lacks, but silently skips one the model lacks: a
    changed model would load partially. Both directions are checked first, by name."""
    prefix = f"{MODEL_KEY}."
    try:
        metadata = SafeFileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except Exception:  # unreadable: the load itself reports it, as one CheckpointError
        return None
    saved = {key[len(prefix) :] for key in metadata if key.startswith(prefix)}
    wanted = set(model.state_dict())
    missing, extra = sorted(wanted - saved), sorted(saved - wanted)
    if not missing and not extra:
        return None

    def few(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    parts = [f"{len(missing)} of this model's parameters are not in it ({few(missing)})"] if missing else []
    parts += [f"it holds {len(extra)} parameters this model lacks ({few(extra)})"] if extra else []
    return (
        f"checkpoint {ckpt} holds another model: {'; '.join(parts)}. Build the model it was trained with (its "
        "run's [model] config); nothing was loaded"
    )


def _names(steps: list[int] | list[Path]) -> str:
    return ", ".join(step_dir("", s).name if isinstance(s, int) else s.name for s in steps) or "none"


@dataclass(frozen=True)
class Chosen:
    """The checkpoint `CheckpointManager.select` settled on, verified on every rank."""

    path: Path
    step: int | None  # N of its step-N directory name (None for another name)
    world_size: int  # the world size that saved it
    verified: bool  # False: saved before manifests existed, loaded unverified
    retire: tuple[Path, ...] = ()  # a load_step rollback: newer checkpoints set aside once this one loads
    damaged: tuple[Path, ...] = ()  # this folder's newer checkpoints that failed verification: moved aside too


@dataclass
class _Pending:
    step: int
    hashed: Future  # this rank's background write, then its digests: dict[str, FileEntry]


# ---------------------------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------------------------


class CheckpointManager:
    """Saves, verifies and loads step-<n> checkpoints under `folder`; see the module docstring.

    Construct it, save, poll and load on every rank: all are collective when torch.distributed
    is initialised. `rank` and `world_size` default to those of the default process group (or 0
    and 1 without one); given explicitly, they must agree with it. `on_saved(step, directory,
    seconds)` is called on rank 0 once a checkpoint is complete (seconds since its save began).
    `load_step` is the run's checkpoint.load_step (-1: none): every marker records it, so that a
    requeue of a run resumed at load_step N tells its own newer checkpoints from older ones (see
    `select`). `warn(message)` tells of skipped or unverified checkpoints and other surprises (rank 0
    only); by default a CheckpointWarning. `set_aside_damaged`: once a load has skipped damaged checkpoints
    of this folder, rename them to step-N.damaged, so that a run saving here again never overwrites them.
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
        load_step: int = -1,
        warn: Callable[[str], None] | None = None,
        set_aside_damaged: bool = False,
    ):
        if keep_latest_k < 0:
            raise ValueError(f"keep_latest_k = {keep_latest_k} is invalid; allowed: 0 (keep all) or a positive count")
        self.folder = Path(folder)
        self.keep_latest_k = keep_latest_k
        self.async_save = async_save
        self.load_step = load_step
        self.set_aside_damaged = set_aside_damaged
        self.rank, self.world_size = _resolve_rank(rank, world_size)
        # Gloo groups of our own, off NCCL: one for what the calling thread does (barriers, verdicts,
        # digests, synchronous DCP), one for the async writer's thread, whose collectives must never
        # interleave with the calling thread's (poll() runs while the write is in flight).
        self._group = dist.new_group(backend="gloo") if _dist_on() else None
        self._writer_group = dist.new_group(backend="gloo") if _dist_on() and async_save else None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") if async_save else None
        self.on_saved = on_saved
        self._warn = warn or (lambda message: warnings.warn(message, CheckpointWarning, stacklevel=4))
        self._pending: _Pending | None = None
        self._save_began = 0.0
        self._closed = False  # the folder itself appears with the first save

    # -- queries --------------------------------------------------------------------------------

    def checkpoint_dir(self, step: int) -> Path:
        return step_dir(self.folder, step)

    def latest_step(self) -> int | None:
        """Newest step with a COMPLETE marker under the folder, or None (not verified). Reads locally."""
        return latest_complete_step(self.folder)

    def saved_world_size(self, step: int) -> int:
        ckpt = self.checkpoint_dir(step)
        if not is_complete(ckpt):
            raise CheckpointNotFoundError(_not_found(ckpt, self.folder))
        try:
            return read_marker(ckpt).world_size
        except MarkerError as e:
            raise CheckpointError(f"checkpoint {ckpt}: {e}") from None

    # -- save -----------------------------------------------------------------------------------

    @torch.no_grad()
    def save(self, step: int, state: dict[str, Any], rank_state: dict[str, Any] | None = None) -> None:
        """Write `state` through DCP and `rank_state` to this rank's own file, as step-<step>.

        Synchronous: returns when the checkpoint is complete (manifest and marker written,
        retention done). Asynchronous: returns once the state is copied to CPU memory; it completes
        at the first poll() after every rank's write, or at the next save(), wait() or close().
        """
        self._check_open()
        self.wait()  # one checkpoint in flight at a time
        if MODEL_KEY not in state:
            warnings.warn(
                f"checkpoint state has no {MODEL_KEY!r} key; load_model_only will not find weights in it", stacklevel=2
            )
        ckpt = self.checkpoint_dir(step)
        data, refused = None, None
        if rank_state is not None:
            try:
                data = safe_bytes(rank_state, f"the rank_state of rank {self.rank}")
            except TypeError as e:
                refused = str(e)
        if not self._all_true(refused is None):  # every rank refuses, so none waits in dcp.save
            raise TypeError(refused or "another rank's rank_state cannot be saved (see its error)")
        self._save_began = time.perf_counter()
        if self.rank == 0:
            self._fresh_dir(ckpt)
        self._barrier()  # the directory exists before any rank writes into it
        if data is not None:
            write_bytes_atomic(ckpt / rank_file(self.rank), data, durable=True)
        if self.async_save:
            result = dcp.async_save(state, checkpoint_id=str(ckpt), process_group=self._writer_group)
            self._pending = _Pending(step, self._hasher.submit(self._written_then_hashed, _upload_future(result), ckpt))
        else:
            dcp.save(state, checkpoint_id=str(ckpt), process_group=self._group)
            self._finish(step, self._outcome(lambda: _hash_files(ckpt, _own_files(ckpt, self.rank))))

    def poll(self) -> bool:
        """Finish the in-flight async save if every rank's write is done; never waits. True when it did.

        Collective (every rank calls it at the same point, e.g. after each step): the ranks agree on
        "all done" over a gloo all-reduce, so they finish together. Free when nothing is in flight.
        """
        if self._pending is None:
            return False
        if not self._all_true(self._pending.hashed.done()):
            return False
        self.wait()
        return True

    def wait(self) -> None:
        """Finish the in-flight async save, if any: wait for its writes, then manifest, marker and retention."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        self._finish(pending.step, self._outcome(pending.hashed.result))

    def close(self) -> None:
        """Finish any async save. Call it on every rank before exit, or the last async save never counts."""
        if not self._closed:
            try:
                self.wait()
            finally:
                self._closed = True
                if self._hasher is not None:
                    self._hasher.shutdown(wait=False)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- choose and load ------------------------------------------------------------------------

    def select(self, *, step: int | None = None, path: str | Path | None = None) -> Chosen:
        """The checkpoint to load, verified on every rank (collective); CheckpointError when none verifies.

        Candidates, newest first, each tried until one verifies (the others are skipped with a warning):
        - neither given: every complete checkpoint in the folder;
        - `path`: that step directory, then the older complete ones beside it; or, for a checkpoint
          folder (or a run folder), its complete checkpoints;
        - `step`: that step, then older ones;
        - `step` equal to this manager's `load_step` (the run's checkpoint.load_step N): if a run
          resumed at N and requeued since has saved newer checkpoints (their markers record load_step
          N), those, then N, then older ones. With no such checkpoint this is a rollback to N: N,
          then older ones; the checkpoints newer than N (another timeline) are moved to
          <folder>/rolled_back/<time>/ once the load has succeeded.
        """
        if step is not None and path is not None:
            raise ValueError("pass step or path to select() or load(), not both")
        plan: tuple[list[tuple[str, Marker | str]], list[str]] | str
        try:
            plan = self._plan(step, path) if self.rank == 0 else ([], [])
        except CheckpointNotFoundError as e:
            plan = str(e)
        plan = self._broadcast(plan)  # rank 0 reads the folder and the markers: every rank tries the same list
        if isinstance(plan, str):
            raise CheckpointNotFoundError(plan)
        candidates, retire = plan
        tried, damaged = [], []
        for where, marker in candidates:
            ckpt = Path(where)
            problems = [f"{COMPLETE_NAME}: {marker}"] if isinstance(marker, str) else self._verify(ckpt, marker)
            if not problems:
                if not marker.verifiable and self.rank == 0:
                    self._warn(
                        f"checkpoint {ckpt} has no manifest (saved before checkpoints were verified): loading it "
                        "unverified"
                    )
                return Chosen(
                    ckpt, step_of(ckpt), marker.world_size, marker.verifiable, tuple(map(Path, retire)),
                    damaged=tuple(damaged),
                )  # fmt: skip
            tried.append(f"{ckpt.name}: {'; '.join(problems)}")
            if ckpt.parent == self.folder:  # this run's own: never another run's folder
                damaged.append(ckpt)
            if self.rank == 0:
                self._warn(
                    f"checkpoint {ckpt} is damaged and is skipped: {'; '.join(problems)}"
                    + ("; trying the next older one" if (where, marker) != candidates[-1] else "")
                )
        home = Path(candidates[0][0]).parent if candidates else self.folder
        raise CheckpointError(f"no checkpoint under {home} verifies; tried {' | '.join(tried)}")

    @torch.no_grad()
    def load(
        self,
        state: dict[str, Any],
        *,
        step: int | None = None,
        path: str | Path | None = None,
        checkpoint: Chosen | None = None,
        optional: tuple[str, ...] = (),
    ) -> dict[str, Any] | None:
        """Load a verified checkpoint into `state` in place: `checkpoint` if given, else `select(step, path)`.

        `optional`: keys of `state` that a checkpoint written before they existed lacks; there they keep their
        values (e.g. the spike monitor's window starts empty) instead of failing the load.

        Stateful values get load_state_dict; plain values are replaced in `state`, so read them
        back from it. Returns this rank's rank_state when the checkpoint was saved at the current
        world size and holds a file for this rank, else None. Any failure is a CheckpointError on
        every rank, naming the checkpoint.
        """
        self.wait()  # never read a checkpoint that is still being written
        chosen = checkpoint if checkpoint is not None else self.select(step=step, path=path)
        if isinstance(state.get(MODEL_KEY), ModelState):
            mismatch = model_mismatch(chosen.path, state[MODEL_KEY])  # the same on every rank: one metadata file
            if mismatch:
                raise CheckpointError(mismatch)
        own, error = None, None
        try:
            reader = SafeFileSystemReader(str(chosen.path))
            target = state
            if optional:
                saved = {fqn.split(".", 1)[0] for fqn in reader.read_metadata().state_dict_metadata}
                target = {k: v for k, v in state.items() if k not in optional or k in saved}
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), process_group=self._group)
            state.update(target)  # plain values were replaced in `target`
            mine = chosen.path / rank_file(self.rank)
            if chosen.world_size == self.world_size and mine.is_file():
                own = load_rank_file(mine)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            error = _load_failure(e)
        errors = [e for e in self._all_gather(error) if e]
        if errors:  # every rank raises the same error, so none goes on into a collective alone
            unverified = "" if chosen.verified else " (it has no manifest, so it could not be verified first)"
            raise CheckpointError(f"loading checkpoint {chosen.path} failed{unverified}: {errors[0]}")
        if chosen.retire:
            self._retire(chosen)
        if chosen.damaged and self.set_aside_damaged:
            self._set_aside(chosen.damaged)
        return own

    # -- internals ------------------------------------------------------------------------------

    def _written_then_hashed(self, write: Any, ckpt: Path) -> dict[str, FileEntry]:
        """In the hashing thread: wait for this rank's background write, then hash its files."""
        write.result()
        return _hash_files(ckpt, _own_files(ckpt, self.rank))

    @staticmethod
    def _outcome(compute: Callable[[], dict[str, FileEntry]]) -> dict[str, FileEntry] | str:
        """This rank's digests, or what went wrong (as text, so the ranks can agree on failing)."""
        try:
            return compute()
        except Exception as e:  # the write failed, or a file vanished
            return f"rank {_global_rank()}: {type(e).__name__}: {e}"

    def _finish(self, step: int, outcome: dict[str, FileEntry] | str) -> None:
        """Every rank's digests -> rank 0 writes the marker with the manifest; retention; on_saved."""
        ckpt = self.checkpoint_dir(step)
        outcomes = self._all_gather(outcome)  # also the barrier: every rank's files are on disk
        failed = [o for o in outcomes if isinstance(o, str)]
        if failed:  # the directory stays unmarked: never loaded, removed by a later retention
            raise RuntimeError(f"saving checkpoint {ckpt} failed: {'; '.join(failed)}")
        if self.rank == 0:
            files: dict[str, FileEntry] = {}
            for digests in outcomes:
                files.update(digests)
            # Anything DCP wrote that no rank claimed (another file naming) is hashed here.
            files.update(_hash_files(ckpt, [n for n in files_on_disk(ckpt) if n not in files]))
            info = {"step": step, "world_size": self.world_size, "time": time.time(), "torch": torch.__version__}
            write_marker(ckpt, {**info, "load_step": self.load_step}, files)
        self._barrier()  # every rank may now treat the checkpoint as complete
        if self.rank == 0 and self.keep_latest_k > 0:
            self._apply_retention(just_saved=step)
        if self.rank == 0 and self.on_saved is not None:
            self.on_saved(step, ckpt, time.perf_counter() - self._save_began)

    def _fresh_dir(self, ckpt: Path) -> None:
        """Empty step directory with its rank_state subdirectory (rank 0 only)."""
        if ckpt.exists():
            if is_complete(ckpt):
                self._warn(f"overwriting the complete checkpoint {ckpt}")
            _remove_checkpoint(ckpt)  # leftovers of a crashed save, a damaged checkpoint, or a repeated step
        (ckpt / RANK_STATE_DIR).mkdir(parents=True, exist_ok=True)

    def _apply_retention(self, just_saved: int) -> None:
        # Only at or below the step just saved: newer directories are not this run's to judge.
        complete = [s for s in complete_steps(self.folder) if s <= just_saved]
        keep = set(complete[-self.keep_latest_k :]) | {just_saved}
        for step, ckpt in step_dirs(self.folder):
            if step not in keep and step < just_saved:
                _remove_checkpoint(ckpt)

    def _verify(self, ckpt: Path, marker: Marker) -> list[str]:
        """Every rank's problems with `ckpt`, each rank checking its share of the files; all agree."""
        try:
            mine = local_problems(ckpt, marker, self.rank, self.world_size)
        except Exception as e:  # never leave the other ranks waiting below
            mine = [f"rank {self.rank} could not check it: {short_reason(e)}"]
        return sorted(p for problems in self._all_gather(mine) for p in problems)

    def _plan(self, step: int | None, path: str | Path | None) -> tuple[list[tuple[str, Marker | str]], list[str]]:
        """(candidates with their markers or what is wrong with them, directories a rollback retires)."""
        retire: list[Path] = []
        if path is not None:
            dirs = _path_candidates(Path(path))
        else:
            complete = complete_steps(self.folder)
            if step is None:
                if not complete:
                    raise CheckpointNotFoundError(
                        f"no complete checkpoint (step-<n>/{COMPLETE_NAME}) under {self.folder}"
                    )
                dirs = [self.checkpoint_dir(s) for s in reversed(complete)]
            elif step == self.load_step:
                dirs, retire = self._load_step_candidates(step, complete)
            elif step in complete:
                dirs = [self.checkpoint_dir(s) for s in reversed(complete) if s <= step]
            else:
                raise CheckpointNotFoundError(_not_found(self.checkpoint_dir(step), self.folder))
        return [(str(d), _marker_or_problem(d)) for d in dirs], [str(d) for d in retire]

    def _load_step_candidates(self, step: int, complete: list[int]) -> tuple[list[Path], list[Path]]:
        newer = [s for s in complete if s > step]
        ours = [s for s in newer if _marker_load_step(self.checkpoint_dir(s)) == step]
        older = [s for s in reversed(complete) if s < step]
        if not ours and step not in complete:
            raise CheckpointNotFoundError(_not_found(self.checkpoint_dir(step), self.folder))
        chosen = [*reversed(ours), *([step] if step in complete else []), *older]
        retire = [] if ours else [d for s, d in step_dirs(self.folder) if s > step]
        return [self.checkpoint_dir(s) for s in chosen], retire

    def _retire(self, chosen: Chosen) -> None:
        """Rank 0 moves the checkpoints a rollback leaves behind out of the folder (never deletes them)."""
        if self.rank == 0:
            target = self.folder / ROLLED_BACK_DIR / time.strftime("%Y%m%d-%H%M%S")
            target.mkdir(parents=True, exist_ok=True)
            for ckpt in chosen.retire:
                if ckpt.exists():
                    os.replace(ckpt, target / ckpt.name)
            self._warn(
                f"resumed at {chosen.path.name} (checkpoint.load_step): moved the newer checkpoints "
                f"{_names(list(chosen.retire))} to {target}, out of the way of this run's new ones"
            )
        self._barrier()

    def _set_aside(self, damaged: tuple[Path, ...]) -> None:
        """Rank 0 renames the damaged checkpoints a resume skipped to step-N.damaged (never deletes them), so
        the run's next save of step N does not overwrite what someone may want to inspect or repair."""
        if self.rank == 0:
            for ckpt in damaged:
                if not ckpt.exists():
                    continue
                target = ckpt.with_name(f"{ckpt.name}{DAMAGED_SUFFIX}")
                n = 1
                while target.exists():
                    n += 1
                    target = ckpt.with_name(f"{ckpt.name}{DAMAGED_SUFFIX}-{n}")
                os.replace(ckpt, target)
                self._warn(f"moved the damaged checkpoint {ckpt.name} aside to {target} (kept, not deleted)")
        self._barrier()

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def _broadcast(self, obj: Any) -> Any:
        if self._group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _all_gather(self, obj: Any) -> list[Any]:
        if self._group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _all_true(self, flag: bool) -> bool:
        if self._group is None:
            return flag
        votes = torch.tensor([1 if flag else 0])
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self._group)
        return bool(votes.item())

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


def _marker_or_problem(ckpt: Path) -> Marker | str:
    try:
        return read_marker(ckpt)
    except MarkerError as e:
        return str(e)


def _marker_load_step(ckpt: Path) -> int | None:
    marker = _marker_or_problem(ckpt)
    return marker.load_step if isinstance(marker, Marker) else None


def _not_found(ckpt: Path, folder: Path) -> str:
    """`ckpt` is not a checkpoint: what it is, and the complete checkpoints `folder` does hold."""
    state = "does not exist" if not ckpt.exists() else f"has no {COMPLETE_NAME} marker (not a finished save)"
    return f"checkpoint {ckpt} {state}; complete checkpoints under {folder}: {_names(complete_steps(folder))}"


def _path_candidates(path: Path) -> list[Path]:
    """A step directory and the older complete ones beside it; or a checkpoint or run folder's complete ones."""
    if is_complete(path):
        own = step_of(path)
        older = [step_dir(path.parent, s) for s in reversed(complete_steps(path.parent))] if own is not None else []
        return [path, *(d for d in older if step_of(d) < own)]
    for folder in (path, RunFolder.of(path).checkpoints):
        steps = complete_steps(folder)
        if steps:
            return [step_dir(folder, s) for s in reversed(steps)]
    if step_of(path) is not None or step_dirs(path.parent):  # meant as a step of the folder it is in
        raise CheckpointNotFoundError(_not_found(path, path.parent))
    what = "does not exist" if not path.exists() else f"holds neither {COMPLETE_NAME} nor complete step-<n> checkpoints"
    raise CheckpointNotFoundError(f"checkpoint {path} {what}")


# ---------------------------------------------------------------------------------------------
# Weights only: a checkpoint's model, without the rest of its state
# ---------------------------------------------------------------------------------------------


def _weights_dir(path_or_dir: str | Path) -> Path:
    """A complete step directory, or the newest complete one under a checkpoint folder."""
    path = Path(path_or_dir)
    if is_complete(path):
        return path
    steps = complete_steps(path)
    if steps:
        return step_dir(path, steps[-1])
    raise CheckpointNotFoundError(
        f"{path} is neither a complete checkpoint (with {COMPLETE_NAME}) nor a folder holding one"
        + (
            f"; complete checkpoints under {path.parent}: {_names(complete_steps(path.parent))}"
            if step_of(path) is not None
            else ""
        )
    )


@torch.no_grad()
def checkpoint_problems(ckpt: Path) -> list[str]:
    """What is wrong with a step directory, checked whole in this process: 'file: problem' each."""
    marker = _marker_or_problem(ckpt)
    return [f"{COMPLETE_NAME}: {marker}"] if isinstance(marker, str) else local_problems(ckpt, marker, 0, 1)


def load_model_only(model: nn.Module, path_or_dir: str | Path, *, verified: bool = False) -> Path:
    """Load just the weights of a checkpoint into `model` (sharded or not); returns the dir read.

    `path_or_dir` is a step directory or a checkpoint folder (then its newest complete step). The
    checkpoint is verified first (every file, on every rank: meant for one process, as in eval) unless
    the caller has just done so (`verified`); a damaged one is a CheckpointError naming the file, not a
    silent fallback. Optimizer and other state in the checkpoint are not read. Collective under
    torch.distributed.
    """
    ckpt = _weights_dir(path_or_dir)
    problems = [] if verified else checkpoint_problems(ckpt)
    if problems:
        others = [s for s in complete_steps(ckpt.parent) if step_dir(ckpt.parent, s) != ckpt]
        raise CheckpointError(
            f"checkpoint {ckpt} is damaged: {'; '.join(problems)}; other complete checkpoints beside it: "
            f"{_names(others)} (--step N chooses one)"
        )
    marker = _marker_or_problem(ckpt)
    if not marker.verifiable:
        warnings.warn(f"checkpoint {ckpt} has no manifest: loading it unverified", CheckpointWarning, stacklevel=2)
    mismatch = model_mismatch(ckpt, ModelState(model))
    if mismatch:
        raise CheckpointError(mismatch)
    try:
        dcp.load(
            {MODEL_KEY: ModelState(model)}, storage_reader=SafeFileSystemReader(str(ckpt)), planner=SafeLoadPlanner()
        )
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"loading the weights of checkpoint {ckpt} failed: {_load_failure(e)}") from None
    return ckpt
