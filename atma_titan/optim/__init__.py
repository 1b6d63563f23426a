"""Optimizers and learning-rate schedules (docs/model.md section 6): Muon for the blocks' matrices, AdamW
for the rest, and the schedules that drive both.

    newton_schulz   Muon's orthogonalisation, batched by shape
    ownership       which rank orthogonalises each sharded matrix, and the all-to-alls that take it there
    muon            the Muon optimizer
    container       the recipe's parameter groups and optimizers, stepped as one
    schedules       the learning-rate schedules
"""

from atma_titan.optim.container import Optimizers, build_optimizers, scale_grads_, split_parameters
from atma_titan.optim.muon import Muon
from atma_titan.optim.newton_schulz import (
    MAX_BATCH_ELEMENTS,
    NS_COEFFICIENTS,
    SMALL_MATRIX,
    UpdateBatches,
    batch_shape,
    newton_schulz_flops,
    orthogonalize,
    orthogonalize_all,
)
from atma_titan.optim.ownership import (
    MuonOwnership,
    ShardExchange,
    assign_owners,
    is_whole,
    local_tensors,
    row_sharded_dim,
    shard_rows,
)
from atma_titan.optim.schedules import LRSchedules, lr_factor

__all__ = [name for name in dir() if not name.startswith("_")]
