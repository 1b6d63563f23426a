"""Build an ATMA model: the one builder training, evaluation, the sweep and generation use.

The model is made on the meta device (no memory), handed to an optional `parallel` function
(training passes AC + compile + FSDP2 from atma_titan.parallel; the model itself knows nothing of
it), materialised on `device`, and given its initial weights when a seed is passed. A caller that
loads every weight from a checkpoint next passes no seed.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from atma_titan.models.atma import ATMA
from atma_titan.models.flavors import ModelArgs

__all__ = ["build_model", "initial_weights"]


def initial_weights(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights, made on the CPU from the seed alone: identical at any world size and on any device."""
    model = ATMA(args)
    torch.manual_seed(seed)
    model.init_weights()
    return model.state_dict()


def build_model(
    args: ModelArgs,
    device: torch.device,
    parallel: Callable[[ATMA], None] | None = None,
    seed: int | None = None,
) -> ATMA:
    """Meta device -> `parallel(model)` -> materialise on `device` -> the initial weights of `seed`.

    With seed None the parameters are left uninitialised (computing the initial weights costs a
    full CPU copy of the model), for a caller that loads all of them next.
    """
    with torch.device("meta"):
        model = ATMA(args)
    if parallel is not None:
        parallel(model)
    model.to_empty(device=device)
    if seed is not None:  # full tensors in, each rank keeps its shards (a plain module: a plain load)
        set_model_state_dict(model, initial_weights(args, seed), options=StateDictOptions(full_state_dict=True))
    return model
