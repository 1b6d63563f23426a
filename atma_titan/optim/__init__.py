"""Optimizers and learning-rate schedules (docs/model.md section 6): Muon for the blocks' matrices, AdamW
for the rest, and the schedules that drive both."""

from atma_titan.optim.optimizers import (
    MAX_BATCH_ELEMENTS,
    NS_COEFFICIENTS,
    SMALL_MATRIX,
    LRSchedules,
    Muon,
    MuonOwnership,
    Optimizers,
    ShardExchange,
    UpdateBatches,
    assign_owners,
    batch_shape,
    build_optimizers,
    is_whole,
    local_tensors,
    lr_factor,
    newton_schulz_flops,
    orthogonalize,
    orthogonalize_all,
    row_sharded_dim,
    scale_grads_,
    shard_rows,
    split_parameters,
)

__all__ = [name for name in dir() if not name.startswith("_")]
