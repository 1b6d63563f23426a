"""The Muon optimizer: torch.optim.Muon's step on FSDP2-sharded matrices, its Newton-Schulz batched and
its element-wise passes one launch each."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from atma_titan.kernels.muon_update import apply_updates_, stage_momentum_
from atma_titan.optim.newton_schulz import UpdateBatches, orthogonalize_all
from atma_titan.optim.ownership import ShardExchange, is_whole, local_tensors, row_sharded_dim


class Muon(torch.optim.Muon):
    """torch.optim.Muon that also takes FSDP2-sharded (DTensor) matrices, and batches Newton-Schulz.

    Momentum is kept per shard; Newton-Schulz needs the whole matrix. Each row-sharded matrix (FSDP2's
    Shard(0), HSDP's (Replicate, Shard(0)), shards of uneven size included) has one owner among the ranks
    of its shard group, chosen by assign_owners() from the shapes alone (balanced by Newton-Schulz FLOPs,
    the same on every rank, planned once and cached). A step then takes two all-to-alls per shard group:
    every rank sends its bf16 shard of each matrix to the matrix's owner; each owner orthogonalises its
    whole matrices (orthogonalize_all: batched per shape); every rank gets its rows of each result back.
    Each rank so does ~1/world of the Newton-Schulz work and receives ~1/world of the matrices, where an
    all-gather on every rank had each do all of it. HSDP replica groups each do the same.

    A matrix's result does not depend on which matrices share its batch (orthogonalize_all), so a step
    equals a single-process Muon step bit for bit (tested at 1, 2 and 4 ranks); every shard of a matrix
    comes from its owner's one computation, so ranks and replicas cannot drift apart even where the
    kernels round differently. Plain tensors and a shard group of one rank are orthogonalised in place;
    other DTensor layouts are all-gathered on every rank as before. The element-wise passes are one launch
    each over all matrices (kernels/muon_update: Triton on a GPU, foreach ops elsewhere): a per-matrix loop
    was launch-bound (~160 ms a step for the 370M model). They also take the clip's coefficient and the
    NaN policy's skip flag as tensors on the device (step(grad_scale=..., skip=...)), so the trainer queues
    a whole step before the host has read its loss, and the clip costs no pass of its own.
    """

    def __init__(self, *args, elementwise_impl: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.elementwise_impl = elementwise_impl  # kernels/muon_update: auto | triton | reference
        self._exchanges: dict[tuple, ShardExchange] = {}

    def _exchange(self, mesh, mesh_dim: int, shapes: tuple[tuple[int, int], ...], steps: int) -> ShardExchange:
        key = (mesh, mesh_dim, shapes, steps)
        if key not in self._exchanges:
            self._exchanges[key] = ShardExchange.plan(shapes, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim), steps)
        return self._exchanges[key]

    def _orthogonalize_sharded(self, updates: list[DTensor], steps: int, eps: float) -> list[torch.Tensor]:
        """Each sharded update's orthogonalised rows on this rank, as a plain bf16 tensor: a row-sharded
        matrix through its owner (ShardExchange), any other layout all-gathered and orthogonalised here."""
        gathered: list[int] = []  # every rank holds these whole after the all-gather
        groups: dict[tuple, list[int]] = {}  # row-sharded updates by (mesh, shard dim)
        for i, u in enumerate(updates):
            dim = row_sharded_dim(u)
            if dim is None:
                gathered.append(i)
            else:
                groups.setdefault((u.device_mesh, dim), []).append(i)
        inputs = [updates[i].full_tensor() for i in gathered]
        exchanges = []
        # Every rank has the same parameters with gradients in the same order (FSDP2 reduces them all), so
        # the ranks of a shard group build the same plan and their all-to-alls match.
        for (mesh, dim), members in groups.items():
            plan = self._exchange(mesh, dim, tuple(tuple(updates[i].shape) for i in members), steps)
            owned = plan.gather_owned([updates[i].to_local() for i in members], mesh.get_group(dim))
            exchanges.append((members, plan, mesh.get_group(dim), len(owned)))
            inputs += owned
        done = orthogonalize_all(inputs, steps, eps)  # one batched pass over this rank's whole matrices
        out: list[torch.Tensor] = [None] * len(updates)  # type: ignore[list-item]
        for i, f in zip(gathered, done):  # slicing a result every rank holds needs no communication
            out[i] = distribute_tensor(f, updates[i].device_mesh, updates[i].placements, src_data_rank=None).to_local()
        first = len(gathered)
        for members, plan, group, n_owned in exchanges:
            device = updates[members[0]].device
            for i, rows in zip(members, plan.scatter_back(done[first : first + n_owned], group, device)):
                out[i] = rows
            first += n_owned
        return out

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None, skip: torch.Tensor | None = None):
        """One step, queued whole: `grad_scale` (a scalar on the device, the clip's coefficient) multiplies every
        gradient as it is read, and `skip` (a scalar on the device, non-zero: leave parameters and momenta as
        they are) is read by the kernels themselves, so the host need not know the step's loss first."""
        if closure is not None:
            raise ValueError("Muon here takes no closure")
        for group in self.param_groups:
            self._step_group(group, grad_scale, skip)
        return None

    def _step_group(self, group: dict, grad_scale: torch.Tensor | None, skip: torch.Tensor | None) -> None:
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        # Element-wise work runs on the local shards (a buffer is laid out as its gradient): DTensor's dispatch
        # costs host time per tensor, which a one-micro-batch step waits for on the GPU.
        bufs = local_tensors([self.state[p]["momentum_buffer"] for p in params])
        local_grads = local_tensors(grads)
        # The bf16 updates: a matrix whole on this rank straight into its Newton-Schulz batch slot, a sharded
        # one into its own tensor (exchanged between ranks or gathered, _orthogonalize_sharded).
        whole: list[int] = []
        sharded: list[int] = []
        for i, g in enumerate(grads):
            (whole if is_whole(g) else sharded).append(i)
        batches = UpdateBatches([tuple(local_grads[i].shape) for i in whole], local_grads[0].device)
        outs: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        for i, slot in zip(whole, batches.slots):
            outs[i] = slot
        for i in sharded:
            outs[i] = torch.empty_like(local_grads[i], dtype=torch.bfloat16)
        stage_momentum_(local_grads, bufs, outs, momentum, group["nesterov"], grad_scale=grad_scale, skip=skip,
                        impl=self.elementwise_impl)  # fmt: skip
        orthogonal: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        for i, x in zip(whole, batches.orthogonalize(group["ns_steps"], group["eps"])):
            orthogonal[i] = x
        if sharded:
            updates = [
                DTensor.from_local(outs[i], grads[i].device_mesh, grads[i].placements, run_check=False,
                                   shape=grads[i].shape, stride=grads[i].stride())
                for i in sharded
            ]  # fmt: skip
            for i, x in zip(sharded, self._orthogonalize_sharded(updates, group["ns_steps"], group["eps"])):
                orthogonal[i] = x
        # torch.optim.Muon's scale: by the matrix's aspect ratio.
        alphas = [-lr * math.sqrt(max(1.0, p.shape[0] / p.shape[1])) for p in params]
        # In place on each parameter's own shard: the decay and the bf16 update added to the fp32 shard
        # (promoted inside the add, as torch.optim.Muon's param.add_ does).
        apply_updates_(local_tensors(params), orthogonal, 1 - lr * wd, alphas, skip=skip, impl=self.elementwise_impl)
