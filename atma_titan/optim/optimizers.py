"""Optimizers and learning-rate schedules (docs/model.md section 6).

Muon takes every >=2-D weight inside the blocks (Newton-Schulz on the whole matrix); AdamW takes
the rest in three groups: the embedding, the LM head, and every 1-D parameter (norms, biases,
per-head scalars), each with its own learning rate.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from atma_titan.config import LRScheduler, Optimizer
from atma_titan.kernels.muon_update import apply_updates_, stage_momentum_

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz, as in torch.optim.Muon
MAX_BATCH_ELEMENTS = 1 << 28  # matrices stacked into one Newton-Schulz batch: at most 512 MB of bf16


def orthogonalize(
    update: torch.Tensor, steps: int, eps: float = 1e-7, compute_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Newton-Schulz approximation of U V^T for update = U S V^T, returned in bf16.

    `update` is one matrix (rows, cols) or a stack of them (n, rows, cols), each orthogonalised on its own.
    The iteration runs on the short side's Gram matrix. A tall matrix is worked on as it lies: its Gram
    matrix is x^T x and the polynomial multiplies x from the right (x^T's iteration, transposed), so the
    products read no transposed copy and the result comes out in the input's layout.

    The products run in `compute_dtype`, by default bf16 on a GPU (torch.optim.Muon's recipe, bit for bit)
    and fp32 on the CPU, where bf16 matrix products have no fast kernel on most machines: in bf16 they
    took 55% of a debug-model training step on a 2-core CPU, and the step ran 2.4x faster in fp32."""
    a, b, c = NS_COEFFICIENTS
    if compute_dtype is None:
        compute_dtype = torch.float32 if update.device.type == "cpu" else torch.bfloat16
    x = update.to(compute_dtype)
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    tall = x.size(-2) > x.size(-1)
    fused = torch.baddbmm if x.dim() == 3 else torch.addmm  # input * beta + alpha * (m1 @ m2)
    for _ in range(steps):
        gram = x.mT @ x if tall else x @ x.mT
        poly = fused(gram, gram, gram, beta=b, alpha=c)  # symmetric: x^T's left product is x's right one
        x = fused(x, x, poly, beta=a) if tall else fused(x, poly, x, beta=a)
    return x.bfloat16()


# Matrices at most this small (short side, long side) are launch-bound: each Newton-Schulz product takes
# a kernel launch whatever its size. They are zero-padded to this one shape and share a batch (below).
SMALL_MATRIX = (32, 1024)


def batch_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) shape a matrix is orthogonalised at in orthogonalize_all(): its own, or, for a small
    one, SMALL_MATRIX (wide) with the matrix turned wide in its corner.

    Zero rows and columns leave the others' Newton-Schulz result as it is (the Gram matrix gains zero rows
    and columns, every product keeps them zero), so a padded matrix is cut back to its own result."""
    rows, cols = shape[-2:]
    if min(rows, cols) <= SMALL_MATRIX[0] and max(rows, cols) <= SMALL_MATRIX[1]:
        return SMALL_MATRIX
    return rows, cols


class UpdateBatches:
    """bf16 Newton-Schulz batches for matrices of the given shapes, one per batch_shape() (capped at
    MAX_BATCH_ELEMENTS): a model has a few shapes repeated over its blocks (the small ones all together),
    so a step launches a few dozen kernels, not thousands.

    `slots[i]` is matrix i's place in its batch, a view of the matrix's own shape (a small tall one turned
    wide, zero-padded around), where its update is written: by one multi-tensor cast copy
    (orthogonalize_all) or by Muon's element-wise kernel. A tall matrix is not turned (see orthogonalize()):
    transposing copies of the large tall matrices, in and out, were slow strided kernels on the GPU.
    `orthogonalize()` returns each matrix's bf16 result of its own shape, laid out as a contiguous matrix
    except for a small one's (a view into its padded batch).

    Every matrix goes through the batched (3-D) products, a lone one as a batch of one, so the kernels a
    matrix meets do not depend on which other matrices share its batch, and each batch entry is its own
    product: a matrix's result does not depend on its company (tested on CPU). The owner of a matrix under
    sharded Muon batches other matrices than a single process does and so gets the same bits. A GPU BLAS
    may pick another algorithm for another batch count; `benchmarks/muon_ownership.py --batch-invariance`
    checks that on the device."""

    def __init__(self, shapes: list[tuple[int, int]], device: torch.device):
        self.slots: list[torch.Tensor] = [None] * len(shapes)  # type: ignore[list-item]
        self._batches = []  # (batch, [(matrix, turned, rows, cols)])
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, shape in enumerate(shapes):
            by_shape.setdefault(batch_shape(shape), []).append(i)
        for (rows, cols), indices in by_shape.items():
            per_batch = max(1, MAX_BATCH_ELEMENTS // (rows * cols))  # bounds the stacked copies' memory
            for first in range(0, len(indices), per_batch):
                members = []
                for i in indices[first : first + per_batch]:
                    r, c = shapes[i][-2:]
                    # Only a small matrix is turned (to fit the wide SMALL_MATRIX) or padded; zeros only then.
                    turned = (rows, cols) == SMALL_MATRIX and r > c
                    members.append((i, turned, *((c, r) if turned else (r, c))))
                padded = any((r, c) != (rows, cols) for _, _, r, c in members)
                make = torch.zeros if padded else torch.empty  # no memset of a batch the copy fills
                batch = make((len(members), rows, cols), dtype=torch.bfloat16, device=device)
                for slot, (i, turned, r, c) in zip(batch.unbind(0), members):
                    self.slots[i] = slot[:r, :c].mT if turned else slot[:r, :c]
                self._batches.append((batch, members))

    def orthogonalize(self, steps: int, eps: float) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [None] * len(self.slots)  # type: ignore[list-item]
        for batch, members in self._batches:
            for (i, turned, r, c), x in zip(members, orthogonalize(batch, steps, eps).unbind(0)):
                out[i] = x[:r, :c].mT if turned else x[:r, :c]
        return out


def orthogonalize_all(updates: list[torch.Tensor], steps: int, eps: float) -> list[torch.Tensor]:
    """orthogonalize() of every matrix, in bf16, batched by UpdateBatches (one multi-tensor cast copy of the
    updates, each in its own layout, into their slots); each result is a bf16 tensor of its update's shape."""
    if not updates:
        return []
    batches = UpdateBatches([tuple(u.shape) for u in updates], updates[0].device)
    torch._foreach_copy_(batches.slots, updates)
    return batches.orthogonalize(steps, eps)


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> int:
    """FLOPs (2 per multiply-add) of orthogonalize() on one (rows, cols) matrix: per iteration, with
    s = min(rows, cols) and l = max, the Gram matrix (2 s^2 l), its square (2 s^3) and the product
    with x (2 s^2 l)."""
    s, l = sorted(shape[-2:])
    return steps * (4 * s * s * l + 2 * s**3)


@dataclass(frozen=True)
class MuonOwnership:
    """Which rank orthogonalises each matrix, and what that costs each rank per optimizer step."""

    owners: tuple[int, ...]  # owner rank of each matrix, in the order of the shapes given
    rank_flops: tuple[int, ...]  # Newton-Schulz FLOPs per step of each rank

    @property
    def total_flops(self) -> int:
        """What every rank computed when each orthogonalised every matrix."""
        return sum(self.rank_flops)


def assign_owners(shapes, world_size: int, steps: int = 5) -> MuonOwnership:
    """One owner per matrix, balancing Newton-Schulz FLOPs over `world_size` ranks.

    Longest-processing-time-first greedy: matrices by descending cost (ties by position), each to the
    rank with the least load so far (ties to the lowest rank). It uses only the shapes and the world
    size, so every rank computes the same assignment without communicating."""
    return _assign_owners(tuple(tuple(int(n) for n in s) for s in shapes), int(world_size), int(steps))


@functools.lru_cache(maxsize=64)
def _assign_owners(shapes: tuple[tuple[int, ...], ...], world_size: int, steps: int) -> MuonOwnership:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    costs = [newton_schulz_flops(s, steps) for s in shapes]
    owners = [0] * len(shapes)
    loads = [(0, rank) for rank in range(world_size)]  # a heap of (FLOPs so far, rank)
    for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + costs[i], rank))
    rank_flops = [0] * world_size
    for i, rank in enumerate(owners):
        rank_flops[rank] += costs[i]
    return MuonOwnership(tuple(owners), tuple(rank_flops))


def shard_rows(rows: int, world_size: int) -> list[int]:
    """Rows of a Shard(0) DTensor on each rank: torch.chunk's split (ceil(rows / world) each, the last
    ranks fewer or none), which both DTensor and FSDP2 use for dims that do not divide evenly."""
    size = -(-rows // world_size)
    return [max(0, min(size, rows - rank * size)) for rank in range(world_size)]


def row_sharded_dim(u: DTensor) -> int | None:
    """The mesh dim that shards `u` by rows when every other mesh dim replicates it (FSDP2: (Shard(0),);
    HSDP: (Replicate(), Shard(0))), else None (such layouts take the all-gather path)."""
    shard_dims = [d for d, p in enumerate(u.placements) if not isinstance(p, Replicate)]
    if len(shard_dims) == 1 and type(u.placements[shard_dims[0]]) is Shard and u.placements[shard_dims[0]].dim == 0:
        return shard_dims[0]
    return None


def is_whole(u: torch.Tensor) -> bool:
    """Whether this rank holds the whole matrix: a plain tensor, or a DTensor row-sharded over a shard
    group of one rank (replicated on any other mesh dim)."""
    if not isinstance(u, DTensor):
        return True
    dim = row_sharded_dim(u)
    return dim is not None and u.device_mesh.size(dim) == 1


def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's local shard (a view: in-place updates reach the DTensor), plain tensors as they are."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


@dataclass(frozen=True)
class ShardExchange:
    """The all-to-all layout of one shard group's matrices (see Muon): from shapes and group size only."""

    rank: int
    owners: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]  # rows[i][k]: rows of matrix i that rank k holds
    cols: tuple[int, ...]
    by_owner: tuple[tuple[int, ...], ...]  # by_owner[k]: the matrices rank k owns, in parameter order
    to_owner: tuple[int, ...]  # elements this rank sends to each rank: its shards of the matrices that rank owns
    from_ranks: tuple[int, ...]  # elements this rank receives from each rank: their shards of its own matrices

    @classmethod
    def plan(cls, shapes: tuple[tuple[int, int], ...], world_size: int, rank: int, steps: int) -> "ShardExchange":
        owners = assign_owners(shapes, world_size, steps).owners
        rows = tuple(tuple(shard_rows(r, world_size)) for r, _ in shapes)
        cols = tuple(c for _, c in shapes)
        by_owner = tuple(tuple(i for i, o in enumerate(owners) if o == k) for k in range(world_size))
        to_owner = tuple(sum(rows[i][rank] * cols[i] for i in by_owner[k]) for k in range(world_size))
        from_ranks = tuple(sum(rows[i][k] * cols[i] for i in by_owner[rank]) for k in range(world_size))
        return cls(rank, owners, rows, cols, by_owner, to_owner, from_ranks)

    def gather_owned(self, shards: list[torch.Tensor], group) -> list[torch.Tensor]:
        """First all-to-all: every rank sends its bf16 shard of each matrix to the matrix's owner, which
        returns its whole matrices (bf16, as single-process Muon's Newton-Schulz batches hold them: the same bits)."""
        for i, shard in enumerate(shards):
            if shard.shape != (self.rows[i][self.rank], self.cols[i]):
                raise RuntimeError(
                    f"Muon: a Shard(0) matrix of {self.rows[i]} rows per rank has local shape {tuple(shard.shape)}"
                    f" on rank {self.rank}; expected torch.chunk's ({self.rows[i][self.rank]}, {self.cols[i]})"
                )
        send = torch.cat([shards[i].bfloat16().reshape(-1) for owned in self.by_owner for i in owned])
        recv = send.new_empty(sum(self.from_ranks))
        dist.all_to_all_single(recv, send, list(self.from_ranks), list(self.to_owner), group=group)
        mine = self.by_owner[self.rank]
        if not mine:
            return []
        sizes = [self.rows[i][k] * self.cols[i] for k in range(len(self.from_ranks)) for i in mine]
        pieces = recv.split(sizes)
        return [
            torch.cat([pieces[k * len(mine) + j].view(self.rows[i][k], self.cols[i]) for k in range(len(self.rows[i]))])
            for j, i in enumerate(mine)
        ]

    def scatter_back(self, orthogonal: list[torch.Tensor], group, device: torch.device) -> list[torch.Tensor]:
        """Second all-to-all: each owner sends every rank its bf16 rows of the orthogonalised matrices;
        returns this rank's bf16 slice of every matrix, in parameter order."""
        mine = self.by_owner[self.rank]
        pieces = []
        for k in range(len(self.from_ranks)):
            for i, f in zip(mine, orthogonal):
                first = sum(self.rows[i][:k])
                pieces.append(f[first : first + self.rows[i][k]].reshape(-1))
        # bf16 on the wire: the results are bf16 values (orthogonalize), so the cast back loses nothing.
        send = torch.cat(pieces).bfloat16() if pieces else torch.empty(0, dtype=torch.bfloat16, device=device)
        recv = torch.empty(sum(self.to_owner), dtype=torch.bfloat16, device=device)
        dist.all_to_all_single(recv, send, list(self.to_owner), list(self.from_ranks), group=group)
        sizes = [self.rows[i][self.rank] * self.cols[i] for owned in self.by_owner for i in owned]
        order = [i for owned in self.by_owner for i in owned]
        out: list[torch.Tensor] = [None] * len(self.owners)  # type: ignore[list-item]
        for i, piece in zip(order, recv.split(sizes)):
            out[i] = piece.view(self.rows[i][self.rank], self.cols[i])
        return out


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
