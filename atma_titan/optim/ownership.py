"""Which rank orthogonalises each matrix under sharded Muon, and the two all-to-alls that bring a
row-sharded matrix whole to its owner and its orthogonalised rows back (plus the DTensor layout helpers)."""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from atma_titan.optim.newton_schulz import newton_schulz_flops


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
