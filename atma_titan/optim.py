"""Optimizers and learning-rate schedules (docs/model.md section 6).

Muon takes every >=2-D weight inside the blocks (Newton-Schulz on the whole matrix); AdamW takes
the rest in three groups: the embedding, the LM head, and every 1-D parameter (norms, biases,
per-head scalars), each with its own learning rate.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from atma_titan.config import LRScheduler, Optimizer

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz, as in torch.optim.Muon
MAX_BATCH_ELEMENTS = 1 << 28  # matrices stacked into one Newton-Schulz batch: at most 512 MB of bf16


def orthogonalize(update: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz approximation of U V^T for update = U S V^T, in bf16 (torch.optim.Muon's recipe).

    `update` is one matrix (rows, cols) or a stack of them (n, rows, cols), each orthogonalised on its own."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16()
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    fused = torch.baddbmm if x.dim() == 3 else torch.addmm  # input * beta + alpha * (m1 @ m2)
    for _ in range(steps):
        gram = x @ x.mT
        x = fused(x, fused(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def orthogonalize_all(updates: list[torch.Tensor], steps: int, eps: float) -> list[torch.Tensor]:
    """orthogonalize() of every matrix, stacking those of one shape into one batched product: a model
    has a few shapes repeated over its blocks, so a step launches a few dozen kernels, not thousands."""
    by_shape: dict[torch.Size, list[int]] = {}
    for i, u in enumerate(updates):
        by_shape.setdefault(u.shape, []).append(i)
    out: list[torch.Tensor] = [None] * len(updates)  # type: ignore[list-item]
    for shape, indices in by_shape.items():
        per_batch = max(1, MAX_BATCH_ELEMENTS // shape.numel())  # bounds the stacked copies' memory
        for first in range(0, len(indices), per_batch):
            chunk = indices[first : first + per_batch]
            if len(chunk) == 1:  # unstacked: the same products as torch.optim.Muon, bit for bit
                out[chunk[0]] = orthogonalize(updates[chunk[0]], steps, eps)
                continue
            for i, x in zip(chunk, orthogonalize(torch.stack([updates[i] for i in chunk]), steps, eps).unbind(0)):
                out[i] = x
    return out


class Muon(torch.optim.Muon):
    """torch.optim.Muon that also takes FSDP2-sharded (DTensor) matrices, and batches Newton-Schulz.

    Momentum is kept per shard; Newton-Schulz needs the whole matrix, so each sharded update is
    all-gathered, orthogonalised, and each rank keeps its own slice. Every rank does the same
    arithmetic on the same full matrix, so one step equals a single-process Muon step. Matrices of
    one shape are orthogonalised together (orthogonalize_all) and the element-wise updates use
    foreach kernels: a per-matrix loop was launch-bound (~160 ms a step for the 370M model).
    """

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon here takes no closure")
        for group in self.param_groups:
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            if group["nesterov"]:
                # Formed in the gradients (zeroed after the step): DTensor has only in-place foreach lerp.
                torch._foreach_lerp_(grads, bufs, momentum)
            updates = grads if group["nesterov"] else bufs
            whole = [u.full_tensor() if isinstance(u, DTensor) else u for u in updates]
            orthogonal = orthogonalize_all(whole, group["ns_steps"], group["eps"])
            for p, u, f in zip(params, updates, orthogonal):
                if isinstance(u, DTensor):
                    # src_data_rank=None: every rank holds `f` already, so slicing needs no communication.
                    f = distribute_tensor(f, u.device_mesh, u.placements, src_data_rank=None)
                rows, cols = p.shape
                p.mul_(1 - lr * wd)
                p.add_(f.to(p.dtype), alpha=-lr * math.sqrt(max(1.0, rows / cols)))
        return None


def split_parameters(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Partition trainable parameters into the groups of the recipe, by name and shape."""
    groups: dict[str, list[nn.Parameter]] = {"matrix": [], "embed": [], "head": [], "scalar": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("embed."):
            groups["embed"].append(p)
        elif name.startswith("head."):
            groups["head"].append(p)
        elif name.startswith("blocks.") and p.ndim >= 2:
            groups["matrix"].append(p)
        else:
            groups["scalar"].append(p)
    return groups


class Optimizers:
    """Several optimizers stepped, zeroed and checkpointed as one."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {str(i): opt.state_dict() for i, opt in enumerate(self.optimizers)}

    def load_state_dict(self, state: dict) -> None:
        for i, opt in enumerate(self.optimizers):
            opt.load_state_dict(state[str(i)])

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]


def build_optimizers(model: nn.Module, cfg: Optimizer) -> Optimizers:
    groups = split_parameters(model)
    adam_groups = [
        {"params": groups["embed"], "lr": cfg.embed_lr, "name": "embed"},
        {"params": groups["head"], "lr": cfg.head_lr, "name": "head"},
        {"params": groups["scalar"], "lr": cfg.scalar_lr, "name": "scalar"},
    ]
    optimizers = []
    if cfg.name == "muon_adamw":
        if groups["matrix"]:
            optimizers.append(
                Muon(
                    [{"params": groups["matrix"], "name": "matrix"}],
                    lr=cfg.muon_lr,
                    weight_decay=cfg.muon_weight_decay,
                    momentum=cfg.muon_momentum,
                    nesterov=True,
                    ns_steps=cfg.muon_ns_steps,
                )
            )
    else:
        adam_groups.append({"params": groups["matrix"], "lr": cfg.matrix_lr, "name": "matrix"})
    adam_groups = [g for g in adam_groups if g["params"]]
    optimizers.append(
        torch.optim.AdamW(
            adam_groups,
            betas=tuple(cfg.adam_betas),
            eps=cfg.adam_eps,
            weight_decay=cfg.adam_weight_decay,
        )
    )
    return Optimizers(optimizers)


def lr_factor(cfg: LRScheduler, total_steps: int) -> Callable[[int], float]:
    """Multiplier of each group's peak lr for the optimizer step that follows `done` completed steps."""
    warmup = cfg.warmup_steps
    floor = cfg.min_lr_ratio

    def constant_then_linear(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        start = max(warmup, int(cfg.decay_start * total_steps))
        if done < start:
            return 1.0
        progress = (done - start) / max(1, total_steps - start)
        return floor + (1.0 - floor) * max(0.0, 1.0 - progress)

    def warmup_cosine(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        progress = min(1.0, (done - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return {"constant_then_linear": constant_then_linear, "warmup_cosine": warmup_cosine}[cfg.name]


class LRSchedules:
    """One LambdaLR per optimizer, all following the same factor."""

    def __init__(self, optimizers: Optimizers, cfg: LRScheduler, total_steps: int):
        factor = lr_factor(cfg, total_steps)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict:
        return {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}

    def load_state_dict(self, state: dict) -> None:
        for i, s in enumerate(self.schedulers):
            s.load_state_dict(state[str(i)])
