"""The recipe's optimizers (docs/model.md section 6), stepped, zeroed and checkpointed as one.

Muon takes every >=2-D weight inside the blocks (Newton-Schulz on the whole matrix); AdamW takes
the rest in three groups: the embedding, the LM head, and every 1-D parameter (norms, biases,
per-head scalars), each with its own learning rate.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from atma_titan.config import Optimizer
from atma_titan.optim.muon import Muon
from atma_titan.optim.ownership import local_tensors


def scale_grads_(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply `grads` in place by `scale` (a scalar tensor), on their local shards in one foreach launch."""
    local = local_tensors(grads)  # views: the DTensors change too
    if local:
        torch._foreach_mul_(local, scale.to(local[0].device))


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


def _decides_on_device(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` takes the step's skip flag on the device: Muon, or a fused optimizer (found_inf)."""
    return isinstance(opt, Muon) or bool(opt.defaults.get("fused"))


def _step(opt: torch.optim.Optimizer, grad_scale: torch.Tensor | None, skip: torch.Tensor | None = None) -> None:
    """One optimizer's step; `skip` (Muon, or a fused AdamW through found_inf) decided on the device."""
    if isinstance(opt, Muon):
        opt.step(grad_scale=grad_scale, skip=skip)
    elif skip is None:
        opt.step()
    else:
        opt.found_inf = skip  # read by a fused optimizer's kernel, as under a GradScaler
        try:
            opt.step()
        finally:
            del opt.found_inf


class Optimizers:
    """Several optimizers stepped, zeroed and checkpointed as one."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def step(
        self,
        allowed: Callable[[], bool] = lambda: True,
        skip: torch.Tensor | None = None,
        grad_scale: torch.Tensor | None = None,
    ) -> bool:
        """Step every optimizer if `allowed()`, which is asked once; returns its answer.

        `grad_scale` (a scalar on the device: the clip's coefficient) multiplies every gradient first: Muon
        reads it in its kernel as it reads the gradient, the other optimizers' gradients are scaled in one
        foreach pass. `allowed()` may wait for the GPU (the trainer reads the step's loss and gradient norm
        there: the NaN policy). With `skip` (a float scalar on the parameters' device, 1.0 where the step
        must not update) the optimizers that can decide on the device are queued whole before it is asked,
        so the GPU has their work while the host waits: Muon (its kernels read the flag) and a fused AdamW
        (found_inf, as under a GradScaler); both then leave parameters and state as they are on a skip, and
        `allowed()` must answer as the flag does. The others step after a yes. Every optimizer goes through
        its step(), which LR schedulers track."""
        if grad_scale is not None:  # Muon reads it in its kernel; the others' gradients are scaled here
            groups = [g for opt in self.optimizers if not isinstance(opt, Muon) for g in opt.param_groups]
            scale_grads_([p.grad for g in groups for p in g["params"] if p.grad is not None], grad_scale)
        on_device = [o for o in self.optimizers if skip is not None and _decides_on_device(o)]
        for opt in on_device:
            _step(opt, grad_scale, skip)
        go = bool(allowed())
        if go:
            for opt in self.optimizers:
                if opt not in on_device:
                    _step(opt, grad_scale)
        return go

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
    on_gpu = all(p.is_cuda for g in adam_groups for p in g["params"])
    optimizers.append(
        torch.optim.AdamW(
            adam_groups,
            betas=tuple(cfg.adam_betas),
            eps=cfg.adam_eps,
            weight_decay=cfg.adam_weight_decay,
            fused=on_gpu or None,  # one kernel for all tensors: foreach took ~9 ms a step for the 370M model
        )
    )
    return Optimizers(optimizers)
