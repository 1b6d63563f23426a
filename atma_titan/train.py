"""The training entry point.

    python -m atma_titan.train --config train_configs/X.toml [--section.key value ...]
    torchrun --nproc_per_node=8 -m atma_titan.train --config train_configs/X.toml

Reads top to bottom in four parts:

- the start: what the run folder holds (a finished run, a checkpoint to resume, another run);
- `setup`: run folder -> metric sinks -> data -> model (meta device, AC + compile + FSDP2,
  materialised, initial weights) -> optimizers -> resume -> loader, all held by one `Run`;
- `train_step`: micro-batches forward/backward -> gradient norm -> one all-reduce -> optimizer step (the clip
  and the NaN policy's skip applied on the device) -> the step's values read on the host;
- `after_step`: validation -> metrics line -> checkpoint -> stop request; then `finish` (DONE, export,
  the summary).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from atma_titan.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    Chosen,
    model_state,
    optimizer_state,
)
from atma_titan.checkpoint.weights import export_safetensors
from atma_titan.config import ConfigError, JobConfig, help_text, load_config
from atma_titan.config.validation import config_warnings
from atma_titan.data import TrainData
from atma_titan.data.mixture_data import MixtureData, open_train_data
from atma_titan.data.skips import SkipState, StreamSkips, skip_pairs
from atma_titan.data.boundaries import document_starts
from atma_titan.utils.cli import command
from atma_titan.utils.device import (
    CpuThreads,
    cap_device_memory,
    copy_to_host,
    load_average,
    resolve_device,
    set_cpu_threads,
)
from atma_titan.utils.errors import InputError, import_optional
from atma_titan.run.bad_batch import TOP_PARAMETERS, BadBatchRecorder
from atma_titan.run.faults import FaultInjector
from atma_titan.run.watchdog import Watchdog
from atma_titan.run.lock import lock_run_folder
from atma_titan.run.gc_schedule import GCSchedule
from atma_titan.hf.load import HF_CONFIG, load_hf_weights
from atma_titan.metrics import (
    MetricsLogger,
    Throughput,
    device_memory_gib,
    flops_per_token,
    format_duration,
    peak_flops,
)
from atma_titan.models import ATMA, ModelArgs, build_model, parameter_breakdown, resolve_model_args
from atma_titan.models.atma import non_embedding_params
from atma_titan.models.loss import LossTargets
from atma_titan.optim import LRSchedules, Optimizers, build_optimizers
from atma_titan.optim.muon import Muon
from atma_titan.parallel.grad_norm import each_norm
from atma_titan.parallel.memory_plan import print_memory_plan
from atma_titan.parallel import (
    LaunchEnv,
    ParallelDims,
    all_reduce_sum,
    clip_coefficient,
    clip_grads_,
    destroy_distributed,
    init_distributed,
    parallelize,
    set_micro_batch,
    total_norm,
)
from atma_titan.run.preemption import LauncherWatch, StopRequest
from atma_titan.run.spikes import LossSpike, Spike, SpikeMonitor
from atma_titan.run.resume_check import Change, check_resume
from atma_titan.profiling.window import StepProfiler
from atma_titan.run.folder import RunFolder, step_dir
from atma_titan.eval.validation import Validator


class NonFiniteLoss(RuntimeError):
    """A NaN/Inf loss or gradient under training.nan_policy = 'abort' (exit status 3)."""


# Entries of the checkpoint state newer than some checkpoints: loading one of those leaves them as they start.
ADDED_STATE = ("spike_monitor", "data_skip")

HF_FOLDER = "hf"  # checkpoint.export_hf writes <dump_folder>/hf/


class ExportError(RuntimeError):
    """Training finished (DONE is written) but the weight export failed (exit status 1; a re-run retries it)."""


@dataclass
class TrainState:
    """Where the run is: the optimizer steps taken and the position in the global token stream."""

    step: int = 0
    tokens_seen: int = 0
    windows_consumed: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, int(value))


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is cut: sequences, ranks, micro-batches."""

    global_batch: int  # sequences per step, all ranks
    accum: int  # micro-batches per step on each rank
    micro_batch: int
    seq_len: int
    dp_degree: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @classmethod
    def of(cls, t, dp_degree: int) -> BatchPlan:
        """From the [training] section; every rank must get whole micro-batches."""
        global_batch = t.batch_tokens // t.seq_len
        per_round = t.micro_batch_size * dp_degree
        if global_batch % per_round:
            raise ConfigError(
                f"'training.batch_tokens' = {t.batch_tokens} is {global_batch} sequences of {t.seq_len}, which is "
                f"not a multiple of training.micro_batch_size ({t.micro_batch_size}) x data-parallel ranks "
                f"({dp_degree}) = {per_round}: every rank must get whole micro-batches."
            )
        return cls(global_batch, global_batch // per_round, t.micro_batch_size, t.seq_len, dp_degree)

    def describe(self) -> str:
        return (
            f"{self.global_batch} x {self.seq_len} = {self.tokens_per_step:,} tokens a step "
            f"({self.accum} micro-batch{'es' if self.accum > 1 else ''} of {self.micro_batch} on each of "
            f"{self.dp_degree} rank{'s' if self.dp_degree > 1 else ''})"
        )


@dataclass(frozen=True)
class StepStats:
    loss: float
    aux: float
    grad_norm: float
    lr: float
    stop: bool  # some rank was asked to stop (SIGTERM / SIGUSR1)
    spike: Spike | None = None  # the step spiked (run/spikes.py)


# ---------------------------------------------------------------------------------------------
# Small pieces the step and the set-up use


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token CE; with `weights` (data.recall_weight) each label's term is scaled by its weight."""
    if weights is None:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    per_label = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return (per_label * weights.flatten()).sum()


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm over all (possibly sharded) parameters; clip to `max_norm` when > 0."""
    grads = gradients(model)
    norm = total_norm(grads)
    if max_norm > 0:
        clip_grads_(grads, max_norm, norm)
    return norm


def rng_state(device: torch.device) -> dict:
    """Every RNG's state in plain types (the rank file is loaded with weights_only=True: no numpy arrays)."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    numpy_state = {**state["numpy"], "state": dict(state["numpy"]["state"])}
    numpy_state["state"]["key"] = np.asarray(numpy_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def format_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def print_data_plan(cfg: JobConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """A mixture's plan: per stage and source, the tokens, their share and the passes over the source."""
    if not cfg.data.sources:
        return
    plan = BatchPlan.of(cfg.training, dims.dp_degree)
    data = open_train_data(cfg.data, args.vocab_size, cfg.training.steps)
    print(f"data: a mixture of {len(data.names)} sources, {plan.describe()}")
    for line in data.plan_lines(plan.global_batch, plan.seq_len, cfg.training.steps):
        print(f"  {line}")


def print_parameters(model: ATMA) -> None:
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    for name, count in parameter_breakdown(model).items():
        print(f"  {name:<17} {count:>14,}")


# ---------------------------------------------------------------------------------------------
# The start: what the run folder already holds


@dataclass(frozen=True)
class Start:
    folder: RunFolder
    resume_step: int | None  # this run's own checkpoint to resume from
    complete_at: int | None = None  # the run is finished at this step: nothing to do
    changes: tuple[Change, ...] = ()  # the keys changed since the saved config, all allowed on resume


def read_start(cfg: JobConfig) -> Start:
    """A finished run, a resume of this folder's run, a restart of it, or a new run in an empty folder.

    Refuses (InputError) a folder that holds another run this job would not resume.
    """
    ck = cfg.checkpoint
    folder = RunFolder(Path(cfg.job.dump_folder), ck.folder)
    resume_step = None
    if ck.enable and ck.resume:
        resume_step = ck.load_step if ck.load_step >= 0 else folder.latest_checkpoint_step()
    # Before anything is written: a resume may not change what the checkpoints were trained with.
    resuming = resume_step is not None and folder.config.is_file()
    changes = tuple(check_resume(folder.config, cfg)) if resuming else ()
    done = folder.done_step()
    same_run = resume_step is not None or _saved_config(folder) == cfg.to_toml()
    if done is not None and done >= cfg.training.steps and same_run:
        exported_hf = not ck.export_hf or (folder.path / HF_FOLDER / HF_CONFIG).is_file()
        if (not ck.export_safetensors or folder.safetensors.is_file()) and exported_hf:
            return Start(folder, resume_step, complete_at=done)
        if resume_step is None:
            missing = folder.safetensors.name if exported_hf else f"{HF_FOLDER}/{HF_CONFIG}"
            raise InputError(
                f"{folder.path} is a run complete at step {done} without {missing} and without a "
                "checkpoint to export it from (checkpoint.enable was false); remove the folder to train it again"
            )
        return Start(folder, resume_step, changes=changes)  # resume the final checkpoint: zero steps, then export
    if not same_run:
        _check_unclaimed(folder)
    return Start(folder, resume_step, changes=changes)


def _saved_config(folder: RunFolder) -> str | None:
    return folder.config.read_text() if folder.config.is_file() else None


def _check_unclaimed(folder: RunFolder) -> None:
    """A new run may not start in a folder that holds another run's metrics or DONE marker."""
    steps, done = [row["step"] for row in folder.logged_steps()], folder.done_step()
    if not steps and done is None:
        return
    held = f"metrics.jsonl has steps {steps[0]}..{steps[-1]}" if steps else f"DONE at step {done}"
    raise InputError(
        f"job.dump_folder {folder.path} holds another run ({held}, config.toml differs) and no checkpoint of it "
        "to resume; choose another job.dump_folder, or remove that folder to start over"
    )


# ---------------------------------------------------------------------------------------------
# Set-up


@dataclass
class Run:
    """Everything one training run holds; `with` closes its sinks, signal handlers and checkpointer."""

    cfg: JobConfig
    args: ModelArgs
    dims: ParallelDims
    device: torch.device
    folder: RunFolder
    plan: BatchPlan
    logger: MetricsLogger
    model: ATMA
    optimizers: Optimizers
    schedules: LRSchedules
    state: TrainState
    checkpointer: CheckpointManager
    job_state: dict
    say: Callable[..., None]
    began: float
    data: object = None  # TrainData, or MixtureData for [[data.sources]]
    loader: object = None
    batches: Iterator | None = None
    document_eot: int | None = None  # data.document_mask: the EOT id that begins each document
    loss_fn: Callable = cross_entropy_sum
    use_autocast: bool = False
    throughput: Throughput | None = None
    validator: Validator | None = None
    stop: StopRequest = field(default_factory=StopRequest)
    faults: FaultInjector | None = None
    watchdog: Watchdog | None = None
    spikes: SpikeMonitor | None = None
    skips: StreamSkips = field(default_factory=StreamSkips)
    recorder: BadBatchRecorder | None = None
    profiler: StepProfiler | None = None
    first_step: int = 1
    first_step_done_at: float = 0.0
    saved_step: int | None = None
    last: dict = field(default_factory=dict)
    exits: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.exits.close()


def setup(
    cfg: JobConfig,
    args: ModelArgs,
    start: Start,
    device: torch.device,
    dims: ParallelDims,
    data: TrainData | MixtureData,
) -> Run:
    """Open the run folder's sinks, build model and optimizers, resume, open the loader of the (opened) data."""
    say = print_flush if dims.is_main else (lambda *a, **k: None)
    began = time.perf_counter()
    cpu_threads = set_cpu_threads(device)  # before any op runs; the header says the choice
    seed_everything(cfg.job.seed, cfg.job.deterministic)
    plan = BatchPlan.of(cfg.training, dims.dp_degree)
    folder = start.folder
    if dims.is_main and cfg.job.print_config:
        print(cfg.to_toml(), flush=True)
    with contextlib.ExitStack() as exits:  # closes what is already open if the set-up fails
        checkpointer = open_checkpointer(cfg, dims, folder, say)
        exits.callback(checkpointer.close)
        chosen = choose_checkpoint(cfg, start, checkpointer)  # verified: an older one when the newest is damaged
        # A run without a checkpoint continues after step 0: the rows of a restarted run are dropped.
        resumed_from = chosen.step if start.resume_step is not None else 0
        logger = exits.enter_context(open_logger(cfg, dims, folder, resumed_from))  # wandb fails here, before the build
        ck = cfg.checkpoint
        if ck.export_hf:  # fail now, not after training, when transformers is missing
            import_optional("transformers", "hf", "checkpoint.export_hf = true")
        loads_weights = start.resume_step is not None or bool(ck.load_path or ck.initial_load_hf)
        seed = None if loads_weights else cfg.job.seed  # a checkpoint sets every weight: skip the initial ones
        model = build_model(args, device, parallel=parallel_plan(cfg, dims, device), seed=seed)
        optimizers = build_optimizers(model, cfg.optimizer)
        schedules = LRSchedules(optimizers, cfg.lr_scheduler, cfg.training.steps, decay_from=decay_from(cfg, data))
        state, spikes = TrainState(), SpikeMonitor(cfg.spikes)
        skips = StreamSkips.from_config(cfg.data, plan.global_batch)
        job_state = {
            "model": model_state(model),
            "optimizer": optimizer_state(model, optimizers.optimizers),
            "lr_scheduler": schedules,
            "train_state": state,
            "spike_monitor": spikes,  # its window: a resumed run judges its next step as the straight run would
            "data_skip": SkipState(skips),  # after train_state: checked against its position once loaded
            **data.checkpoint_state(),  # a streamed source's global document cursor
        }
        run = Run(
            cfg=cfg, args=args, dims=dims, device=device, folder=folder, plan=plan, logger=logger, model=model,
            optimizers=optimizers, schedules=schedules, state=state, checkpointer=checkpointer, job_state=job_state,
            say=say, began=began, exits=exits,
        )  # fmt: skip
        run.data, run.spikes, run.skips = data, spikes, skips
        run.document_eot = data.eot_id if cfg.data.document_mask else None
        say_header(run, cpu_threads)
        # Before the loader forks its workers: they inherit the handler, so a Ctrl-C to the process group
        # leaves them running and the step can finish and save.
        run.stop.install()
        exits.callback(run.stop.uninstall)
        rank_state = restore(run, start, chosen)
        if dims.is_main:  # after the checkpoint's own checks (data.skip): a refused resume leaves the folder as it was
            prepare_folder(cfg, folder)
        open_loader(run, data, rank_state)
        prepare_step(run)
        run.exits = exits.pop_all()  # from here on the Run closes them
    return run


def prepare_folder(cfg: JobConfig, folder: RunFolder) -> None:
    """Rank 0: the folder, the resolved config, and no DONE when a finished run is being extended."""
    folder.path.mkdir(parents=True, exist_ok=True)
    folder.config.write_text(cfg.to_toml())
    done = folder.done_step()
    if done is not None and done < cfg.training.steps:
        folder.done.unlink()


def decay_from(cfg: JobConfig, data: TrainData | MixtureData) -> int | None:
    """The steps done when the learning rate starts to decay, where lr_scheduler.decay_stage names a data stage."""
    if not cfg.lr_scheduler.decay_stage:
        return None
    return data.mixture.stage_named(cfg.lr_scheduler.decay_stage).start_step - 1


def open_checkpointer(cfg: JobConfig, dims: ParallelDims, folder: RunFolder, say: Callable) -> CheckpointManager:
    ck = cfg.checkpoint

    def saved(step: int, path: Path, seconds: float) -> None:
        say(f"checkpoint step {step} saved: {path} ({format_bytes(folder_size(path))}, {seconds:.1f} s)")

    return CheckpointManager(
        folder.checkpoints,
        keep_latest_k=ck.keep_latest_k,
        async_save=ck.async_save,
        rank=dims.rank,
        world_size=dims.world_size,
        on_saved=saved,
        load_step=ck.load_step,
        warn=lambda message: print(f"warning: {message}", file=sys.stderr, flush=True),
        set_aside_damaged=True,  # this run saves here again: a damaged step-N must not be overwritten
    )


def print_flush(*args, **kwargs) -> None:
    print(*args, **kwargs, flush=True)


def parallel_plan(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> Callable[[ATMA], None]:
    """AC -> compile -> FSDP2, as the config asks (FSDP only under torchrun)."""
    bf16_shards = device.type == "cuda" and cfg.training.mixed_precision == "bf16"
    return lambda model: parallelize(
        model,
        dims,
        ac_mode=cfg.activation_checkpoint.mode,
        ac_every_n=cfg.activation_checkpoint.every_n,
        ac_save=cfg.activation_checkpoint.selective_save,
        ac_blocks=cfg.activation_checkpoint.blocks,
        compile=cfg.training.compile,
        compile_backend=cfg.training.compile_backend,
        param_dtype=torch.bfloat16 if bf16_shards else None,
        reshard_after_forward=cfg.parallelism.reshard_after_forward,
    )


def open_logger(cfg: JobConfig, dims: ParallelDims, folder: RunFolder, resumed_from: int | None) -> MetricsLogger:
    m = cfg.metrics
    return MetricsLogger(
        dump_folder=folder.path,
        rank=dims.rank,
        stdout=m.stdout,
        jsonl=m.jsonl,
        tensorboard=m.tensorboard,
        wandb=m.wandb,
        wandb_project=m.wandb_project,
        wandb_entity=m.wandb_entity,
        wandb_run_name=m.wandb_run_name or folder.path.name,
        wandb_mode=m.wandb_mode,
        config=cfg.to_dict(),
        resume_step=resumed_from,
    )


def say_header(run: Run, cpu_threads: CpuThreads | None) -> None:
    """The run in three lines: model, batch and length, where its files go; then what may surprise in it
    (the CPU threads, a weighted loss) and the config's warnings on stderr."""
    cfg, args = run.cfg, run.args
    params = sum(p.numel() for p in run.model.parameters())
    n_global = sum(args.is_global(i) for i in range(args.n_layers))
    ranks = f"{run.dims.world_size} rank{'s' if run.dims.world_size > 1 else ''}"
    run.say(
        f"atma_titan: {cfg.model.flavor} model, {params:,} parameters ({args.n_layers} blocks, {n_global} global, "
        f"{args.attention} attention{', memory' if args.memory else ''}) on {run.device}, {ranks}"
    )
    total = cfg.training.steps * run.plan.tokens_per_step
    run.say(f"  batch {run.plan.describe()}; {cfg.training.steps:,} steps = {total:,} tokens")
    ck = cfg.checkpoint
    if not ck.enable:
        saves = "no checkpoints"
    elif ck.interval >= cfg.training.steps:
        saves = f"a checkpoint at the end in {run.folder.checkpoints}"
    else:
        saves = f"checkpoints every {ck.interval} steps and at the end in {run.folder.checkpoints}"
    run.say(f"  run folder {run.folder.path}: {run.folder.config.name}, {run.folder.metrics.name}; {saves}")
    if cpu_threads is not None:
        run.say(f"  {cpu_threads.describe()}")
    if run.dims.world_size > 1:  # the metrics line's throughput is one rank's share of the batch
        run.say(f"  tok/s and mfu are per rank: the job's tokens/s is {run.dims.world_size} x tok/s")
    if cfg.data.recall_weight != 1.0:
        # the recall records' tokens count recall_weight times in the mean: ~37 where plain CE would be ~3
        weight = f"data.recall_weight = {cfg.data.recall_weight:g}"
        run.say(f"  loss is recall-weighted ({weight}): not comparable to plain CE")
    if isinstance(run.data, MixtureData):
        for line in run.data.describe():
            run.say(f"  {line}")
    if run.skips:
        run.say(f"  leaving out the data of {run.skips.describe(run.plan.global_batch)} (data.skip)")
    if run.document_eot is not None:
        run.say(f"  documents kept apart (data.document_mask): each begins at an EOT (id {run.document_eot})")
    if run.dims.is_main:
        load = load_average()
        crowded = cpu_threads.crowded(load) if cpu_threads is not None and load is not None else None
        for message in config_warnings(cfg) + ([crowded] if crowded else []):
            print(f"warning: {message}", file=sys.stderr, flush=True)


def choose_checkpoint(cfg: JobConfig, start: Start, checkpointer: CheckpointManager) -> Chosen | None:
    """The checkpoint to start from, verified on every rank; a damaged one is skipped for the next older one.

    The run's own (the newest, or checkpoint.load_step: see CheckpointManager.select for how a requeue
    after a load_step resume continues from its own newer checkpoints), else checkpoint.load_path.
    """
    ck = cfg.checkpoint
    if start.resume_step is not None:
        where = {"step": ck.load_step} if ck.load_step >= 0 else {}
        key = f"checkpoint.load_step = {ck.load_step}: " if ck.load_step >= 0 else ""
    elif ck.load_path:
        where, key = {"path": ck.load_path}, f"checkpoint.load_path = {ck.load_path!r}: "
    else:
        return None
    try:
        return checkpointer.select(**where)
    except CheckpointError as e:  # say which setting named the checkpoint
        raise type(e)(f"{key}{e}") from None


def restore(run: Run, start: Start, chosen: Chosen | None) -> dict | None:
    """Load the run's own checkpoint, or another run's (`checkpoint.load_path`); returns this rank's state."""
    ck = run.cfg.checkpoint
    if chosen is None:
        if ck.initial_load_hf:  # a new run from an exported Hugging Face folder: its weights only
            try:
                load_hf_weights(run.model, ck.initial_load_hf)
            except InputError as e:
                raise InputError(f"checkpoint.initial_load_hf = {ck.initial_load_hf!r}: {e}") from None
            run.say(f"loaded model weights from {ck.initial_load_hf} (checkpoint.initial_load_hf)")
        return None
    if start.resume_step is not None:
        rank_state = run.checkpointer.load(run.job_state, checkpoint=chosen, optional=ADDED_STATE)
        run.job_state["data_skip"].check(run.state.windows_consumed)
        run.schedules.follow()
        run.saved_step = run.state.step
        run.say(f"resumed from {chosen.path} at step {run.state.step}")
        if start.changes:
            run.say(f"  changed since the run's config.toml: {'; '.join(c.describe() for c in start.changes)}")
        return rank_state
    if ck.model_only:  # weights only: the rank state of another run's step is of no use
        run.checkpointer.load({"model": run.job_state["model"]}, checkpoint=chosen)
        rank_state = None
    else:
        rank_state = run.checkpointer.load(run.job_state, checkpoint=chosen, optional=ADDED_STATE)
        run.job_state["data_skip"].check(run.state.windows_consumed)
        run.schedules.follow()
    run.say(f"loaded {'model weights' if ck.model_only else 'checkpoint'} from {chosen.path}")
    return rank_state


def open_loader(run: Run, data: TrainData | MixtureData, rank_state: dict | None) -> None:
    """This rank's loader at the run's stream position; its exact state and RNGs when the world is unchanged."""
    cfg, plan = run.cfg, run.plan
    run.loader = data.loader(
        seq_len=plan.seq_len,
        global_batch=plan.global_batch,
        micro_batch=plan.micro_batch,
        rank=run.dims.dp_rank,
        world_size=run.dims.dp_degree,
        start_window=run.state.windows_consumed,
        pin_memory=run.device.type == "cuda",
        skips=run.skips,
    )
    # Otherwise a random-access loader was rebuilt from the global stream position, the same at any world size.
    if rank_state is not None and rank_state.get("num_workers") == cfg.data.num_workers:
        run.loader.load_state_dict(rank_state["loader"])
        set_rng_state(rank_state["rng"], run.device)
    elif run.state.step and not data.random_access:  # another split: continue from the global document cursor
        run.say(f"data: {data.resume_note()}")
    run.batches = iter(run.loader)


def prepare_step(run: Run) -> None:
    """The loss function, precision, throughput meter, validator, profiler, fault hooks and hang watchdog."""
    cfg, args, dims, device = run.cfg, run.args, run.dims, run.device
    if cfg.training.compile:  # fused log-softmax: one (tokens x vocab) buffer fewer
        run.loss_fn = torch.compile(cross_entropy_sum, backend=cfg.training.compile_backend)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls of the reference kernels
    run.use_autocast = device.type == "cuda" and cfg.training.mixed_precision == "bf16" and not dims.distributed
    n_attention = sum(args.is_global(i) for i in range(args.n_layers))
    flops = flops_per_token(non_embedding_params(run.model), n_attention, args.n_heads, args.head_dim, run.plan.seq_len)
    run.throughput = Throughput(flops, peak_flops(device))
    mixture = run.data.mixture if isinstance(run.data, MixtureData) else None
    run.validator = Validator(cfg, args.vocab_size, dims, run.document_eot, mixture) if cfg.eval.interval else None
    run.first_step = run.state.step + 1
    run.profiler = run.exits.enter_context(
        StepProfiler(cfg.profiling, run.folder.path, dims.rank, run.first_step, device, run.say)
    )
    run.faults = FaultInjector(cfg.debug, dims.rank)
    run.watchdog = Watchdog.from_config(cfg.watchdog, run.folder.path, dims.rank).start()
    run.exits.callback(run.watchdog.stop)
    run.recorder = BadBatchRecorder(run.folder.path, dims.rank, cfg.spikes.records)


# ---------------------------------------------------------------------------------------------
# One optimizer step


def train_step(run: Run) -> StepStats:
    """Forward/backward over this rank's micro-batches, clip, reduce the loss, apply the NaN policy, step."""
    step, plan, device, dims = run.state.step + 1, run.plan, run.device, run.dims
    loss_sum = torch.zeros((), device=device)
    aux_sum = torch.zeros((), device=device)
    cfg = run.cfg.training
    fused = cfg.loss == "fused"  # the head returns the summed CE: no (tokens x vocab) logits
    chunks = dict(chunk_mib=cfg.loss_chunk_mib, compile_backend=cfg.compile_backend if cfg.compile else None)
    mixture = run.data.counts if isinstance(run.data, MixtureData) else None
    skip_data(run, step)
    run.recorder.start_step()
    for micro in range(plan.accum):
        batch, sources = next(run.batches), None
        if mixture is not None:  # (inputs, labels, sources): count what each source gave, on the host
            (*batch, sources) = batch
            mixture.add(sources, batch[0])
        inputs, labels, *weights = (t.to(device, non_blocking=True) for t in batch)
        if dims.distributed:  # reduce-scatter gradients and free the gathered parameters after the last one
            set_micro_batch(run.model, last=micro == plan.accum - 1)
        targets = LossTargets(labels, *weights, **chunks) if fused else None
        doc_start = None if run.document_eot is None else document_starts(inputs, run.document_eot)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=run.use_autocast):
            out, aux = run.model(inputs, return_aux=True, targets=targets, doc_start=doc_start)
        # sum CE / tokens of the whole global batch: micro-batches and ranks add up to the mean.
        ce_sum = out if fused else run.loss_fn(out, labels, *weights)
        loss = run.faults.loss(step, ce_sum / plan.tokens_per_step)
        run.recorder.add(batch[0], batch[1], sources, loss)
        share = plan.accum * plan.dp_degree
        total = loss if aux is None else loss + aux / share
        # FSDP averages gradients over ranks; the loss is already a global sum, so undo that.
        (total * plan.dp_degree).backward()
        loss_sum += loss.detach()
        if aux is not None:
            aux_sum += aux.detach() / share
    run.faults.after_backward(step)
    grad_norm = total_norm(gradients(run.model))  # global already: not in the sum below
    # The clip: the optimizers multiply the gradients by this as they read them (no pass of its own for Muon's).
    max_norm = run.cfg.training.max_norm
    clip = clip_coefficient(grad_norm, max_norm) if max_norm > 0 else None
    # One small all-reduce a step (global loss, and whether any rank was asked to stop), and the step's one
    # host sync: the NaN policy needs the values. The update itself is decided on the device (skip): Muon and a
    # fused AdamW are queued whole before the optimizers ask, so the GPU works through them while we wait.
    stop = torch.tensor(float(run.stop.requested), pin_memory=device.type == "cuda")  # pinned: copied without a sync
    flags = all_reduce_sum(torch.stack([loss_sum, aux_sum, stop.to(device, non_blocking=True)]), dims)
    totals = torch.cat([flags, grad_norm.reshape(1).to(flags)])  # loss, aux, stop votes, grad norm
    skip = ~torch.isfinite(totals[0::3]).all()  # the NaN policy's test, on the device
    if run.spikes.policy == "skip" and run.spikes.judging:  # the spike test too, as the host will make it
        limits = torch.tensor(run.spikes.thresholds(), pin_memory=device.type == "cuda").to(device, non_blocking=True)
        skip = skip | (totals[0] > limits[0]) | (totals[3] > limits[1])
    skip = skip.float()
    read_totals = copy_to_host(totals)
    values: list[float] = []
    verdict: list[Spike | None] = []

    def allowed() -> bool:  # asked by the optimizers once they have queued what needs no answer
        values.extend(read_totals())
        return update_allowed(run, step, loss=values[0], grad_norm=values[3], clip=clip, spike=verdict)

    run.optimizers.step(allowed, skip, grad_scale=clip)
    loss_value, aux_value, stop_votes, grad_norm = values
    lr = run.optimizers.param_groups[0]["lr"]
    run.schedules.step()
    run.optimizers.zero_grad()
    run.state.step = step
    run.state.tokens_seen += plan.tokens_per_step
    run.state.windows_consumed += plan.global_batch
    run.throughput.update(plan.tokens_per_step // plan.dp_degree)
    run.profiler.step()
    return StepStats(loss_value, aux_value, grad_norm, lr, bool(stop_votes), *verdict)


def skip_data(run: Run, step: int) -> None:
    """At a step where data.skip leaves stream steps out: say so, and drop a streamed source's micro-batches of them
    (a random-access source or a mixture maps its windows past them: data/skips.py)."""
    if not run.skips:
        return
    g = run.plan.global_batch
    first, now = (run.skips.stream_step(step - 1, g) + 1 if step > 1 else 1), run.skips.stream_step(step, g)
    if now == first:
        return
    run.say(f"step {step}: leaving out the data of stream steps {first}..{now - 1} (data.skip)")
    if not (run.data.random_access or isinstance(run.data, MixtureData)):
        for _ in range((now - first) * run.plan.accum):
            next(run.batches)


def update_allowed(
    run: Run, step: int, loss: float, grad_norm: float, clip: torch.Tensor | None = None, spike: list | None = None
) -> bool:
    """Whether the optimizer step may update: not when loss or gradient norm is not finite (training.nan_policy:
    stop or skip) or when they spike (spikes.policy: log, skip or stop). A bad step is recorded first (while its
    gradients exist); its spike, if any, is appended to `spike`."""
    finite = np.isfinite(loss) and np.isfinite(grad_norm)
    found = run.spikes.judge(step, loss, grad_norm)
    if spike is not None and found is not None:
        spike.append(found)
    if (not finite or found is not None) and not run.recorder.full:
        record_bad_step(run, step, loss, grad_norm, found, clip)
    kept = (
        f"the last checkpoint (step {run.saved_step}) is intact"
        if run.saved_step is not None
        else "no checkpoint was saved"
    )
    if not finite:
        if run.cfg.training.nan_policy == "abort":
            raise NonFiniteLoss(
                f"loss is {loss} (grad norm {grad_norm}) at step {step}; stopping, {kept}. Lower the learning rate, "
                "or set training.nan_policy = 'skip' to skip such steps."
            )
        run.say(f"step {step}: loss {loss}, grad norm {grad_norm}: skipping this update")
        return False
    if found is None:
        return True
    policy = run.cfg.spikes.policy
    if policy == "stop":
        raise LossSpike(
            f"step {step} spiked: {found.describe()}; stopping, {kept}. Roll back with checkpoint.load_step and skip "
            f"its data with {skip_advice(run, step)} (docs/training.md, Long runs)."
        )
    run.say(f"step {step} spiked: {found.describe()}{': skipping this update' if policy == 'skip' else ''}")
    return policy != "skip"


def skip_advice(run: Run, step: int) -> str:
    """The data.skip that leaves out the data of `step` (in the stream's numbering) and keeps the ranges in force: the
    new list replaces the old one on the command line."""
    data_step = run.skips.stream_step(step, run.plan.global_batch)
    pairs = [[a, b] for a, b in skip_pairs(run.cfg.data.skip, "data.skip", 1)] + [[data_step, data_step]]
    return f"data.skip = {pairs}"


def record_bad_step(
    run: Run, step: int, loss: float, grad_norm: float, spike: Spike | None, clip: torch.Tensor | None
) -> None:
    """The bad-batch record (run/bad_batch.py): every rank's windows, rank 0's summary. Collective: every rank
    reaches it together, as the verdict comes from the global loss and norm."""
    groups = [g for o in run.optimizers.optimizers if not isinstance(o, Muon) for g in o.param_groups]
    scaled = {id(p) for g in groups for p in g["params"]}  # AdamW's: the clip has scaled their gradients by now
    named = [(name, p) for name, p in run.model.named_parameters() if p.grad is not None]
    norms = each_norm([p.grad for _, p in named])
    if clip is not None:  # undo the clip's scaling (Optimizers.step), so that every norm is the step's own
        was_scaled = torch.tensor([id(p) in scaled for _, p in named], device=norms.device)
        norms = torch.where(was_scaled, norms / clip.to(norms), norms)
    by_size = sorted(
        zip((name for name, _ in named), norms.tolist()), key=lambda x: x[1] if np.isfinite(x[1]) else np.inf
    )
    top = by_size[::-1]
    plan = run.plan
    summary = {
        "step": step,
        "reason": "non-finite" if spike is None else "spike",
        "loss": loss,
        "grad_norm": grad_norm,
        "spike": None if spike is None else asdict(spike),
        "layout": dict(
            ranks=plan.dp_degree,
            micro_batches_per_rank=plan.accum,
            micro_batch=plan.micro_batch,
            seq_len=plan.seq_len,
            windows_before=run.state.windows_consumed,
        ),  # fmt: skip
        "largest_gradient_norms": top[:TOP_PARAMETERS],
        "roll_back": f"checkpoint.load_step = <a step before {step}>, {skip_advice(run, step)}",
    }
    windows = None
    if run.data.random_access or isinstance(run.data, MixtureData):
        first = run.state.windows_consumed + run.dims.dp_rank * (plan.global_batch // plan.dp_degree)
        windows = run.skips.stream_index(np.arange(first, first + plan.global_batch // plan.dp_degree))
    folder = run.recorder.write(step, summary, windows)
    run.say(f"step {step}: the bad batch is recorded in {folder}")


# ---------------------------------------------------------------------------------------------
# After a step: validation, the metrics line, checkpoints, a stop request


def after_step(run: Run, stats: StepStats) -> bool:
    """Evaluate, log and save as due; True when the run must stop now (a stop was requested)."""
    cfg, step = run.cfg, run.state.step
    if step == run.first_step:
        run.first_step_done_at = time.perf_counter()
    last_step = step == cfg.training.steps
    evaluated = {}
    if run.validator and (step % cfg.eval.interval == 0 or last_step):
        evaluated = run.validator.run(run.model, run.device, step)
    due = step == run.first_step or step % cfg.metrics.log_freq == 0 or last_step
    if due or stats.stop or evaluated or stats.spike:
        log_step(run, stats, evaluated)
    ck = cfg.checkpoint
    run.checkpointer.poll()  # an async save completes (marker, retention) once every rank's write is done
    if ck.enable and (step % ck.interval == 0 or last_step or stats.stop):
        run.checkpointer.save(step, run.job_state, rank_state=rank_private_state(run))
        run.saved_step = step
    return stats.stop


def log_step(run: Run, stats: StepStats, evaluated: dict) -> None:
    step = run.state.step
    run.last = {
        "step": step,
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "lr": stats.lr,
        **run.throughput.compute(),
        "memory_gib": device_memory_gib(run.device),
        **evaluated,
    }
    if run.args.distractor_weight > 0:
        run.last["distractor_loss"] = stats.aux
    if stats.spike is not None:
        run.last.update(stats.spike.metrics())
    if isinstance(run.data, MixtureData):  # collective: every rank logs at the same steps
        run.last.update(source_metrics(run.data))
    run.logger.log(step, {k: v for k, v in run.last.items() if k != "step"}, eta_s=eta_seconds(run))


def source_metrics(data: MixtureData) -> dict[str, int]:
    """tokens/<source> and documents/<source> seen so far, all ranks together."""
    totals = data.counts.totals()
    return {f"{key}/{name}": int(n) for key in ("tokens", "documents") for name, n in zip(data.names, totals[key])}


def eta_seconds(run: Run) -> float | None:
    """Time left at the pace since the first step of this process (which compiles and warms up)."""
    done, left = run.state.step - run.first_step, run.cfg.training.steps - run.state.step
    if done < 1 or left < 1:
        return None
    per_step = (time.perf_counter() - run.first_step_done_at) / done
    return per_step * left


def rank_private_state(run: Run) -> dict:
    return {"loader": run.loader.state_dict(), "rng": rng_state(run.device), "num_workers": run.cfg.data.num_workers}


# ---------------------------------------------------------------------------------------------
# The end of a run


def finish(run: Run) -> dict:
    """All steps trained: finish the last save, write DONE, export the weights, print the summary."""
    run.checkpointer.wait()
    if run.dims.is_main:
        run.folder.write_done(run.state.step)
    if run.cfg.checkpoint.export_safetensors:
        export_weights(run)
    if run.cfg.checkpoint.export_hf:
        export_hf_folder(run)
    say_summary(run, "done")
    return run.last


def export_weights(run: Run) -> None:
    path, began = run.folder.safetensors, time.perf_counter()
    try:
        export_safetensors(run.model, path)
    except Exception as e:  # the run itself is complete: say so, keep DONE, and let a re-run retry the export
        raise ExportError(
            f"training is complete (DONE at step {run.state.step}) but writing {path} failed: {e!r}; "
            "re-run the same command to retry the export"
        ) from e
    if run.dims.is_main:
        run.say(f"exported {path} ({format_bytes(path.stat().st_size)}, {time.perf_counter() - began:.1f} s)")


def export_hf_folder(run: Run) -> None:
    from atma_titan.hf.export import export_hf  # imports transformers (the hf extra)

    path, began = run.folder.path / HF_FOLDER, time.perf_counter()
    try:
        export_hf(run.model, path, run.cfg, step=run.state.step, run_dir=run.folder.path)
    except Exception as e:  # as export_weights: the run is complete, a re-run retries the export
        raise ExportError(
            f"training is complete (DONE at step {run.state.step}) but writing {path} failed: {e!r}; "
            "re-run the same command to retry the export"
        ) from e
    if run.dims.is_main:
        run.say(f"exported the Hugging Face folder {path} ({time.perf_counter() - began:.1f} s)")


def say_summary(run: Run, how: str) -> None:
    cfg, state = run.cfg, run.state
    trained = state.step - run.first_step + 1
    seconds = time.perf_counter() - run.began
    lines = [
        f"{how}: step {state.step} of {cfg.training.steps}, {state.tokens_seen:,} tokens seen; this run trained "
        f"{trained} step{'s' if trained != 1 else ''} in {format_duration(seconds)}"
    ]
    if "loss" in run.last:
        val = f", val loss {run.last['val_loss']:.4f}" if "val_loss" in run.last else ""
        lines.append(f"  final train loss {run.last['loss']:.4f}{val}")
    if isinstance(run.data, MixtureData):
        lines += [f"  {line}" for line in run.data.summary(run.data.counts.totals())]
    folder = run.folder
    files = [folder.config.name, folder.metrics.name]
    if run.saved_step is not None:
        files.append(str(step_dir(folder.checkpoint_folder, run.saved_step)))
    if how == "done":
        files.append(folder.done.name)
        if folder.safetensors.is_file():
            files.append(folder.safetensors.name)
    lines.append(f"  run folder {folder.path}: {', '.join(files)}")
    for line in lines:
        run.say(line)


# ---------------------------------------------------------------------------------------------
# The whole job


def train(cfg: JobConfig) -> dict:
    """Run the job described by `cfg`; returns the last logged metrics."""
    launcher = LauncherWatch.start()  # first: torchrun's pid, and SIGTERM from the kernel if it dies
    env = LaunchEnv.from_environ()
    device = resolve_device(cfg.training.device, env.local_rank, what="'training.device'")
    cap_device_memory(device, cfg.debug.memory_cap_gib)
    p = cfg.parallelism
    dims = init_distributed(env, p.dp_replicate, p.dp_shard, device.type, timeout_s=p.timeout_s)
    lock = None
    try:
        args = resolve_model_args(cfg.model)
        if cfg.job.dry_run:
            if dims.is_main:
                with torch.device("meta"):
                    print_parameters(ATMA(args))
                print_data_plan(cfg, args, dims)
                print_memory_plan(cfg, args, env.world_size if env.launched else None)
            return {}
        # Before the folder is read: one job per run folder (all ranks exit 2 together when it is taken).
        # Bad data (a missing file, a manifest of another tokenizer) fails here, before anything is written.
        data = open_train_data(cfg.data, args.vocab_size, cfg.training.steps)
        lock = lock_run_folder(Path(cfg.job.dump_folder), distributed=dims.distributed, is_main=dims.is_main)
        start = read_start(cfg)
        if start.complete_at is not None:
            if dims.is_main:
                print(f"{start.folder.path} is already complete at step {start.complete_at}: nothing to do", flush=True)
            return {}
        with setup(cfg, args, start, device, dims, data) as run:
            run.stop.launcher = launcher
            return run_loop(run)
    finally:
        if lock is not None:
            lock.release()
        destroy_distributed()


def run_loop(run: Run) -> dict:
    steps = run.cfg.training.steps
    if run.state.step >= steps:
        run.say(f"step {run.state.step} = training.steps: nothing left to train")
    else:
        run.say(f"training steps {run.state.step + 1}..{steps}")
    run.model.train()
    with GCSchedule(run.cfg.training.gc_interval) as gc_schedule:
        while run.state.step < steps:
            run.stop.check_launcher()  # torchrun gone (where no SIGTERM came): a stop request like any other
            run.watchdog.step_started(run.state.step + 1)  # only the step is timed: not validation or saves
            stats = train_step(run)
            run.watchdog.step_ended()
            stop = after_step(run, stats)
            gc_schedule.step(run.state.step)
            if stop:
                run.checkpointer.wait()
                say_stopped(run)
                return run.last
    return finish(run)


def say_stopped(run: Run) -> None:
    saved = (
        f"checkpoint step {run.saved_step} saved; run the same command to resume"
        if run.cfg.checkpoint.enable
        else "checkpointing is off, nothing was saved"
    )
    run.say(f"stopped at step {run.state.step} on request ({run.stop.received}): {saved}")
    say_summary(run, "stopped")


@command(statuses={NonFiniteLoss: 3, LossSpike: 3, ExportError: 1})
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    train(load_config(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
