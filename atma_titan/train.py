"""The training entry point: `python -m atma_titan.train --config train_configs/X.toml [--section.key value]`.

Reads top to bottom: config -> model (meta device) -> materialise + init -> optimizers -> data ->
loop(data -> forward/backward over micro-batches -> clip -> step -> metrics).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from atma_titan.config import ConfigError, JobConfig, help_text, load_config
from atma_titan.data import build_source
from atma_titan.data.loader import build_dataloader
from atma_titan.metrics import MetricsLogger, Throughput, device_memory_gib, flops_per_token, peak_flops
from atma_titan.models import ATMA, parameter_breakdown, resolve_model_args
from atma_titan.models.atma import non_embedding_params
from atma_titan.optim import LRSchedules, build_optimizers


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("'training.device' = 'cuda' but no CUDA device is available; use auto or cpu.")
    return torch.device(name)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def build_model(cfg: JobConfig, device: torch.device) -> ATMA:
    """Build on the meta device (no memory), then materialise on `device` and initialise."""
    with torch.device("meta"):
        model = ATMA(resolve_model_args(cfg.model))
    model.to_empty(device=device)
    torch.manual_seed(cfg.job.seed)
    model.init_weights()
    return model


def print_parameters(model: ATMA) -> None:
    total = sum(p.numel() for p in model.parameters())
    print(f"parameters: {total:,}")
    for name, count in parameter_breakdown(model).items():
        print(f"  {name:<17} {count:>14,}")


def gradient_accumulation(cfg: JobConfig, world_size: int) -> tuple[int, int]:
    """(global batch in sequences, micro-batches per step on each rank)."""
    t = cfg.training
    global_batch = t.batch_tokens // t.seq_len
    per_step = t.micro_batch_size * world_size
    if global_batch % per_step:
        raise ConfigError(
            f"'training.batch_tokens' = {t.batch_tokens} is {global_batch} sequences of {t.seq_len}, which is not a "
            f"multiple of training.micro_batch_size ({t.micro_batch_size}) x ranks ({world_size}) = {per_step}."
        )
    return global_batch, global_batch // per_step


def train(cfg: JobConfig) -> dict:
    """Run the job described by `cfg`; returns the last logged metrics."""
    device = pick_device(cfg.training.device)
    seed_everything(cfg.job.seed, cfg.job.deterministic)
    dump = Path(cfg.job.dump_folder)

    if cfg.job.dry_run:
        with torch.device("meta"):
            print_parameters(ATMA(resolve_model_args(cfg.model)))
        return {}

    dump.mkdir(parents=True, exist_ok=True)
    (dump / "config.toml").write_text(cfg.to_toml())
    if cfg.job.print_config:
        print(cfg.to_toml())

    model = build_model(cfg, device)
    args = model.args
    print_parameters(model)
    if cfg.training.compile:
        for name, block in model.blocks.items():
            model.blocks[name] = torch.compile(block, fullgraph=True)

    optimizers = build_optimizers(model, cfg.optimizer)
    schedules = LRSchedules(optimizers, cfg.lr_scheduler, cfg.training.steps)

    global_batch, accum = gradient_accumulation(cfg, world_size=1)
    source = build_source(cfg.data, args.vocab_size)
    batches = iter(build_dataloader(
        source, cfg.training.seq_len, global_batch, cfg.training.micro_batch_size,
        num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda",
    ))
    tokens_per_step = global_batch * cfg.training.seq_len

    use_bf16 = device.type == "cuda" and cfg.training.mixed_precision == "bf16"
    n_attention = sum(args.is_global(i) for i in range(args.n_layers))
    throughput = Throughput(
        flops_per_token(non_embedding_params(model), n_attention, args.n_heads, args.head_dim, cfg.training.seq_len),
        peak_flops(device),
    )
    m = cfg.metrics
    logger = MetricsLogger(
        dump_folder=dump, stdout=m.stdout, jsonl=m.jsonl, tensorboard=m.tensorboard, wandb=m.wandb,
        wandb_project=m.wandb_project, wandb_entity=m.wandb_entity, wandb_run_name=m.wandb_run_name or dump.name,
        wandb_mode=m.wandb_mode, config=cfg.to_dict(),
    )
    print(f"training {cfg.training.steps} steps of {tokens_per_step:,} tokens "
          f"({accum} micro-batches of {cfg.training.micro_batch_size} x {cfg.training.seq_len}) on {device}")

    last: dict = {}
    model.train()
    with logger:
        for step in range(1, cfg.training.steps + 1):
            loss_sum = torch.zeros((), device=device)
            aux_sum = torch.zeros((), device=device)
            for _ in range(accum):
                inputs, labels = (t.to(device, non_blocking=True) for t in next(batches))
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                    logits, aux = model(inputs, return_aux=True)
                # loss = sum CE / tokens of the whole global batch, so micro-batches add up to it exactly.
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / tokens_per_step
                total = loss if aux is None else loss + aux / accum
                total.backward()
                loss_sum += loss.detach()
                if aux is not None:
                    aux_sum += aux.detach() / accum
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), cfg.training.max_norm if cfg.training.max_norm > 0 else float("inf")
            )
            lr = optimizers.param_groups[0]["lr"]
            optimizers.step()
            schedules.step()
            optimizers.zero_grad()
            throughput.update(tokens_per_step)

            if step == 1 or step % m.log_freq == 0 or step == cfg.training.steps:
                loss_value = loss_sum.item()
                if not np.isfinite(loss_value):
                    raise FloatingPointError(f"loss is {loss_value} at step {step}; stopping.")
                last = {"step": step, "loss": loss_value, "grad_norm": grad_norm.item(), "lr": lr,
                        **throughput.compute(), "memory_gib": device_memory_gib(device)}
                if args.distractor_weight > 0:
                    last["distractor_loss"] = aux_sum.item()
                logger.log(step, {k: v for k, v in last.items() if k != "step"})
    return last


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        cfg = load_config(argv)
        train(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
