"""The training entry point.

    python -m atma_titan.train --config train_configs/X.toml [--section.key value ...]
    torchrun --nproc_per_node=8 -m atma_titan.train --config train_configs/X.toml

Reads top to bottom: config -> process groups -> model (meta device) -> AC + compile + FSDP2 ->
materialise + initial weights -> optimizers -> resume -> data -> loop(micro-batches -> clip ->
step -> metrics -> checkpoint) -> DONE marker.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from atma_titan.checkpoint import CheckpointManager, export_safetensors, load_model_only, model_state, optimizer_state
from atma_titan.config import ConfigError, JobConfig, help_text, load_config
from atma_titan.data import TrainData
from atma_titan.data.documents import DataSourceError
from atma_titan.data.shards import ShardError
from atma_titan.data.tokenizer import TokenizerError
from atma_titan.metrics import MetricsLogger, Throughput, device_memory_gib, flops_per_token, peak_flops
from atma_titan.models import ATMA, parameter_breakdown, resolve_model_args
from atma_titan.models.atma import non_embedding_params
from atma_titan.optim import LRSchedules, build_optimizers
from atma_titan.parallel import ParallelDims, all_reduce_sum, destroy_distributed, init_distributed, parallelize
from atma_titan.preemption import StopRequest
from atma_titan.profiling import StepProfiler
from atma_titan.validation import Validator

DONE_MARKER = "DONE"


class NonFiniteLoss(RuntimeError):
    pass


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


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("'training.device' = 'cuda' but no CUDA device is available; use auto or cpu.")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def initial_state_dict(cfg: JobConfig) -> dict:
    """The initial weights, made on the CPU from the seed alone: identical at any world size and on any device."""
    model = ATMA(resolve_model_args(cfg.model))
    torch.manual_seed(cfg.job.seed)
    model.init_weights()
    return model.state_dict()


def build_model(
    cfg: JobConfig, device: torch.device, dims: ParallelDims | None = None, initialise: bool = True
) -> ATMA:
    """Build on the meta device, apply AC / compile / FSDP2, materialise on `device`, load the initial weights.

    `initialise=False` leaves the parameters uninitialised, for a caller that loads every one of them
    from a checkpoint next (computing the initial weights costs a full CPU copy of the model).
    """
    dims = dims or ParallelDims(1, 0, 0, 1, 1)
    with torch.device("meta"):
        model = ATMA(resolve_model_args(cfg.model))
    fsdp_bf16 = device.type == "cuda" and cfg.training.mixed_precision == "bf16"
    parallelize(
        model,
        dims,
        ac_mode=cfg.activation_checkpoint.mode,
        ac_every_n=cfg.activation_checkpoint.every_n,
        compile=cfg.training.compile,
        compile_backend=cfg.training.compile_backend,
        param_dtype=torch.bfloat16 if fsdp_bf16 else None,
        reshard_after_forward=cfg.parallelism.reshard_after_forward,
    )
    model.to_empty(device=device)
    if initialise:
        set_model_state_dict(model, initial_state_dict(cfg), options=StateDictOptions(full_state_dict=True))
    return model


def print_parameters(model: ATMA) -> None:
    total = sum(p.numel() for p in model.parameters())
    print(f"parameters: {total:,}")
    for name, count in parameter_breakdown(model).items():
        print(f"  {name:<17} {count:>14,}")


def gradient_accumulation(cfg: JobConfig, dp_degree: int) -> tuple[int, int]:
    """(global batch in sequences, micro-batches per step on each rank)."""
    t = cfg.training
    global_batch = t.batch_tokens // t.seq_len
    per_step = t.micro_batch_size * dp_degree
    if global_batch % per_step:
        raise ConfigError(
            f"'training.batch_tokens' = {t.batch_tokens} is {global_batch} sequences of {t.seq_len}, which is not a "
            f"multiple of training.micro_batch_size ({t.micro_batch_size}) x data-parallel ranks ({dp_degree}) "
            f"= {per_step}."
        )
    return global_batch, global_batch // per_step


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token CE; with `weights` (data.recall_weight) each label's term is scaled by its weight."""
    if weights is None:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    per_label = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return (per_label * weights.flatten()).sum()


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm over all (possibly sharded) parameters; clip to `max_norm` when > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # sum the shards' partial norms across ranks
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def train(cfg: JobConfig) -> dict:
    """Run the job described by `cfg`; returns the last logged metrics."""
    device = pick_device(cfg.training.device)
    try:
        dims = init_distributed(cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard, device.type)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return _train(cfg, device, dims)
    finally:
        destroy_distributed()


def _train(cfg: JobConfig, device: torch.device, dims: ParallelDims) -> dict:
    main_rank = dims.is_main
    say = print if main_rank else (lambda *a, **k: None)
    seed_everything(cfg.job.seed, cfg.job.deterministic)
    dump = Path(cfg.job.dump_folder)

    if cfg.job.dry_run:
        with torch.device("meta"):
            model = ATMA(resolve_model_args(cfg.model))
        if main_rank:
            print_parameters(model)
        return {}

    global_batch, accum = gradient_accumulation(cfg, dims.dp_degree)
    if main_rank:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "config.toml").write_text(cfg.to_toml())
        (dump / DONE_MARKER).unlink(missing_ok=True)
        if cfg.job.print_config:
            print(cfg.to_toml())

    try:  # open and check the data first: a missing file should not cost a model build
        data = TrainData(cfg.data, resolve_model_args(cfg.model).vocab_size)
    except ValueError as e:  # the message names the file, key or value and what is allowed
        raise ConfigError(str(e)) from None
    # Resume: the run's own newest checkpoint, else an explicit starting point (load_path).
    ckpt_cfg = cfg.checkpoint
    checkpointer = CheckpointManager(
        dump / ckpt_cfg.folder,
        keep_latest_k=ckpt_cfg.keep_latest_k,
        async_save=ckpt_cfg.async_save,
        rank=dims.rank,
        world_size=dims.world_size,
    )
    resume_step = ckpt_cfg.load_step if ckpt_cfg.load_step >= 0 else checkpointer.latest_step()
    resuming = ckpt_cfg.enable and ckpt_cfg.resume and resume_step is not None
    # A loaded checkpoint sets every weight: the initial weights need not be computed then.
    model = build_model(cfg, device, dims, initialise=not (resuming or ckpt_cfg.load_path))
    args = model.args
    if main_rank:
        print_parameters(model)
    optimizers = build_optimizers(model, cfg.optimizer)
    schedules = LRSchedules(optimizers, cfg.lr_scheduler, cfg.training.steps)
    train_state = TrainState()
    job_state = {
        "model": model_state(model),
        "optimizer": optimizer_state(model, optimizers.optimizers),
        "lr_scheduler": schedules,
        "train_state": train_state,
    }
    rank_state = None
    if resuming:
        rank_state = checkpointer.load(job_state, step=resume_step)
        say(f"resumed from {checkpointer.checkpoint_dir(resume_step)} at step {train_state.step}")
    elif ckpt_cfg.load_path:
        if ckpt_cfg.model_only:
            load_model_only(model, ckpt_cfg.load_path)
        else:
            rank_state = checkpointer.load(job_state, path=ckpt_cfg.load_path)
        say(f"loaded {'model weights' if ckpt_cfg.model_only else 'checkpoint'} from {ckpt_cfg.load_path}")

    loader = data.loader(
        seq_len=cfg.training.seq_len,
        global_batch=global_batch,
        micro_batch=cfg.training.micro_batch_size,
        rank=dims.dp_rank,
        world_size=dims.dp_degree,
        start_window=train_state.windows_consumed,
        pin_memory=device.type == "cuda",
    )
    # Same world size and workers: restore this rank's loader and RNGs exactly. Otherwise a random-access
    # loader was rebuilt from the global stream position above, the same stream at any world size.
    if rank_state is not None and rank_state.get("num_workers") == cfg.data.num_workers:
        loader.load_state_dict(rank_state["loader"])
        set_rng_state(rank_state["rng"], device)
    elif train_state.step and not data.random_access:
        say(
            f"warning: data.source = '{cfg.data.source}' streams documents per rank and worker; its position cannot "
            "move to a new world size or worker count, so the stream restarts from its beginning. Use .bin shards "
            "(python -m atma_titan.data.prepare) for exact resumption at any size."
        )
    batches = iter(loader)

    tokens_per_step = global_batch * cfg.training.seq_len
    loss_fn = cross_entropy_sum
    if cfg.training.compile:  # fused log-softmax: one (tokens x vocab) buffer fewer
        loss_fn = torch.compile(cross_entropy_sum, backend=cfg.training.compile_backend)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls of the reference kernels
    use_autocast = device.type == "cuda" and cfg.training.mixed_precision == "bf16" and not dims.distributed
    n_attention = sum(args.is_global(i) for i in range(args.n_layers))
    throughput = Throughput(
        flops_per_token(non_embedding_params(model), n_attention, args.n_heads, args.head_dim, cfg.training.seq_len),
        peak_flops(device),
    )
    m = cfg.metrics
    logger = MetricsLogger(
        dump_folder=dump,
        rank=dims.rank,
        stdout=m.stdout,
        jsonl=m.jsonl,
        tensorboard=m.tensorboard,
        wandb=m.wandb,
        wandb_project=m.wandb_project,
        wandb_entity=m.wandb_entity,
        wandb_run_name=m.wandb_run_name or dump.name,
        wandb_mode=m.wandb_mode,
        config=cfg.to_dict(),
    )
    say(
        f"training steps {train_state.step + 1}..{cfg.training.steps} of {tokens_per_step:,} tokens "
        f"({accum} micro-batches of {cfg.training.micro_batch_size} x {cfg.training.seq_len} on each of "
        f"{dims.dp_degree} ranks) on {device}"
    )

    def save(step: int) -> None:
        checkpointer.save(
            step,
            job_state,
            rank_state={"loader": loader.state_dict(), "rng": rng_state(device), "num_workers": cfg.data.num_workers},
        )

    validator = None
    if cfg.eval.interval:
        validator = Validator(cfg, args.vocab_size, dims)

    stop = StopRequest().install()
    profiler = StepProfiler(cfg.profiling, dump, dims.rank, train_state.step + 1, device, say)
    last: dict = {}
    saved_step = train_state.step
    model.train()
    try:
        with logger, profiler:
            while train_state.step < cfg.training.steps:
                step = train_state.step + 1
                loss_sum = torch.zeros((), device=device)
                aux_sum = torch.zeros((), device=device)
                for micro in range(accum):
                    inputs, labels, *weights = (t.to(device, non_blocking=True) for t in next(batches))
                    if dims.distributed:  # reduce-scatter gradients once, after the last micro-batch
                        model.set_requires_gradient_sync(micro == accum - 1)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                        logits, aux = model(inputs, return_aux=True)
                    # sum CE / tokens of the whole global batch: micro-batches and ranks add up to the mean.
                    loss = loss_fn(logits, labels, *weights) / tokens_per_step
                    if step == cfg.debug.nan_at_step:
                        loss = loss * float("nan")
                    total = loss if aux is None else loss + aux / (accum * dims.dp_degree)
                    # FSDP averages gradients over ranks; the loss is already a global sum, so undo that.
                    (total * dims.dp_degree).backward()
                    loss_sum += loss.detach()
                    if aux is not None:
                        aux_sum += aux.detach() / (accum * dims.dp_degree)
                if step == cfg.debug.signal_at_step and dims.rank == cfg.debug.signal_rank:
                    os.kill(os.getpid(), signal.SIGTERM)
                grad_norm = clip_gradients(model, cfg.training.max_norm)
                # One small all-reduce a step: global loss, and whether any rank was asked to stop.
                stats = all_reduce_sum(
                    torch.stack([loss_sum, aux_sum, torch.tensor(float(stop.requested), device=device)]), dims
                ).tolist()
                loss_value, aux_value, stop_votes = stats[0], stats[1], stats[2]
                grad_value = grad_norm.item()

                finite = np.isfinite(loss_value) and np.isfinite(grad_value)
                if finite:
                    optimizers.step()
                elif cfg.training.nan_policy == "abort":
                    raise NonFiniteLoss(
                        f"loss is {loss_value} (grad norm {grad_value}) at step {step}; stopping. The last "
                        f"checkpoint (step {saved_step}) is intact. Lower the learning rate, or set "
                        "training.nan_policy = 'skip' to skip such steps."
                    )
                else:
                    say(f"step {step}: loss {loss_value}, grad norm {grad_value}: skipping this update")
                lr = optimizers.param_groups[0]["lr"]
                schedules.step()
                optimizers.zero_grad()
                train_state.step = step
                train_state.tokens_seen += tokens_per_step
                train_state.windows_consumed += global_batch
                throughput.update(tokens_per_step // dims.dp_degree)
                profiler.step()

                evaluated = {}
                if validator and (step % cfg.eval.interval == 0 or step == cfg.training.steps):
                    evaluated = validator.run(model, device)
                if step == 1 or step % m.log_freq == 0 or step == cfg.training.steps or stop_votes or evaluated:
                    last = {
                        "step": step,
                        "loss": loss_value,
                        "grad_norm": grad_value,
                        "lr": lr,
                        **throughput.compute(),
                        "memory_gib": device_memory_gib(device),
                        **evaluated,
                    }
                    if args.distractor_weight > 0:
                        last["distractor_loss"] = aux_value
                    logger.log(step, {k: v for k, v in last.items() if k != "step"})

                due = step % ckpt_cfg.interval == 0 or step == cfg.training.steps
                if ckpt_cfg.enable and (due or stop_votes):
                    save(step)
                    saved_step = step
                if stop_votes:
                    checkpointer.wait()
                    say(
                        f"stopped at step {step} on request; "
                        + ("checkpoint saved, rerun to resume" if ckpt_cfg.enable else "checkpointing is off")
                    )
                    return last
        checkpointer.wait()
        if ckpt_cfg.export_safetensors:
            export_safetensors(model, dump / "model.safetensors")
        if main_rank:
            (dump / DONE_MARKER).write_text(f"{train_state.step}\n")
        return last
    finally:
        stop.uninstall()
        checkpointer.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        train(load_config(argv))
    except (ConfigError, ShardError, DataSourceError, TokenizerError) as e:  # bad input: the message says what
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
