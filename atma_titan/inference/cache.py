"""What generation keeps between tokens: K/V pages for the global blocks and a state slot per sequence.

    KV pages      per global block: k, v (num_pages, page_size, Hkv, D), read through block tables
    state slots   per block, one row per sequence:
                    local block    "conv"                        last k-1 inputs of the LFM2 conv (B * x)
                    global block   "canon_q", "canon_k", "canon_v"  last k-1 inputs of the Canon convs
                                   "memory"                      the gated-delta state (H, Dv, Dk), fp32

Page 0 and slot 0 are scratch: the padding rows of a fixed-size (CUDA-graph) decode batch write there,
so no live sequence is touched. The block table of every slot lives on the device, so a decode step
only needs the slots, positions and tokens of its sequences (no host sync, fixed shapes).

A forward with a cache sees a `StepCache`; each block asks it for its `LayerCache`, which is what
the model code reads (models/conv.py, models/attention.py, models/memory.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from atma_titan.utils.errors import InputError
from atma_titan.kernels.paged import gather_pages, write_pages
from atma_titan.models import ModelArgs

__all__ = ["CacheFullError", "LayerCache", "ModelCache", "SequenceAllocation", "StateView", "StepCache"]

SCRATCH = 0  # the scratch page and the scratch slot


class CacheFullError(InputError):
    """A sequence can never fit the cache (its prompt and new tokens exceed the pool)."""


@dataclass(frozen=True)
class StateView:
    """Rows `slots` (B,) of a state pool (num_slots, ...): read() gathers them, write() stores them back."""

    pool: torch.Tensor
    slots: torch.Tensor

    def read(self) -> torch.Tensor:
        return self.pool.index_select(0, self.slots)

    def write(self, value: torch.Tensor) -> None:
        self.pool.index_copy_(0, self.slots, value.to(self.pool.dtype))


@dataclass(frozen=True)
class LayerCache:
    """One block's view of the cache during one forward of B sequences, T tokens each.

    decoding: one token per sequence (T = 1) at `positions`, keys read from the pages by the decode
    kernels; otherwise a prefill chunk of one sequence, attending over every key cached so far.
    """

    decoding: bool
    positions: torch.Tensor  # (B, T) absolute positions of the tokens
    slots: torch.Tensor  # (B,) state slots
    block_table: torch.Tensor  # (B, blocks) int32
    pools: dict[str, torch.Tensor]
    k_pages: torch.Tensor | None = None
    v_pages: torch.Tensor | None = None
    length: int = 0  # prefill: keys cached after this chunk (a host number)

    def state(self, name: str) -> StateView:
        return StateView(self.pools[name], self.slots)

    def append_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Decode: store the tokens' k, v (B, 1, Hkv, D); returns the paged view the decode kernels take,
        (k_pages, v_pages, block_table, context_lens)."""
        write_pages(self.k_pages, self.v_pages, self.block_table, self.positions, k, v)
        context_lens = (self.positions[:, -1] + 1).to(torch.int32)
        return self.k_pages, self.v_pages, self.block_table, context_lens

    def extend_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill: store the chunk's k, v (1, T, Hkv, D); returns every cached key and value (1, length, Hkv, D)."""
        write_pages(self.k_pages, self.v_pages, self.block_table, self.positions, k, v)
        k_all = gather_pages(self.k_pages, self.block_table)[:, : self.length]
        v_all = gather_pages(self.v_pages, self.block_table)[:, : self.length]
        return k_all.to(k.dtype), v_all.to(v.dtype)


@dataclass(frozen=True)
class StepCache:
    """The cache as one forward sees it: `layer(i)` is block i's LayerCache."""

    cache: "ModelCache"
    decoding: bool
    positions: torch.Tensor
    slots: torch.Tensor
    block_table: torch.Tensor
    length: int = 0

    def layer(self, i: int) -> LayerCache:
        c = self.cache
        return LayerCache(
            self.decoding, self.positions, self.slots, self.block_table, c.pools[i], c.k_pages.get(i),
            c.v_pages.get(i), self.length,
        )  # fmt: skip


@dataclass
class SequenceAllocation:
    slot: int
    pages: list[int]


class ModelCache:
    """The pages and state slots of up to `max_seqs` sequences of at most `max_context` tokens each.

    num_pages defaults to enough for max_seqs full-length sequences (plus the scratch page); a smaller
    pool admits fewer long sequences at once. `dtype` is the dtype of the keys, values and conv states
    (the model's activation dtype); the memory states are always fp32.
    """

    def __init__(
        self,
        args: ModelArgs,
        *,
        max_seqs: int,
        max_context: int,
        page_size: int = 16,
        num_pages: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if max_seqs < 1 or max_context < 1:
            raise InputError(f"the cache needs max_seqs >= 1 and max_context >= 1 (got {max_seqs}, {max_context})")
        if page_size < 1 or page_size & (page_size - 1):
            raise InputError(f"page_size must be a power of two, got {page_size}")
        self.args = args
        self.page_size = page_size
        self.max_context = max_context
        self.max_blocks = math.ceil(max_context / page_size)
        self.num_pages = num_pages if num_pages is not None else max_seqs * self.max_blocks + 1
        self.device = torch.device(device)
        num_slots = max_seqs + 1
        a = args

        def pool(*shape, dtype=dtype):
            return torch.zeros(num_slots, *shape, dtype=dtype, device=self.device)

        self.pools: dict[int, dict[str, torch.Tensor]] = {}
        self.k_pages: dict[int, torch.Tensor] = {}
        self.v_pages: dict[int, torch.Tensor] = {}
        page_shape = (self.num_pages, page_size, a.n_kv_heads, a.head_dim)
        for i in range(a.n_layers):
            pools = {}
            if not a.is_global(i):
                pools["conv"] = pool(a.conv_kernel - 1, a.d_model)
            else:
                self.k_pages[i] = torch.zeros(page_shape, dtype=dtype, device=self.device)
                self.v_pages[i] = torch.zeros(page_shape, dtype=dtype, device=self.device)
                if a.canon:
                    for name, heads in (("canon_q", a.n_heads), ("canon_k", a.n_kv_heads), ("canon_v", a.n_kv_heads)):
                        pools[name] = pool(a.canon_kernel - 1, heads * a.head_dim)
                if a.memory:
                    pools["memory"] = pool(a.n_heads, a.head_dim, a.head_dim, dtype=torch.float32)
            self.pools[i] = pools
        # every slot's block table, on the device; unused entries point at the scratch page
        self.block_tables = torch.full((num_slots, self.max_blocks), SCRATCH, dtype=torch.int32, device=self.device)
        self._free_pages = list(range(self.num_pages - 1, SCRATCH, -1))
        self._free_slots = list(range(max_seqs, SCRATCH, -1))

    # -- allocation (host side) ----------------------------------------------------------------

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def check_fits(self, tokens: int, what: str = "a sequence") -> None:
        """Raise CacheFullError unless a sequence of `tokens` tokens fits an empty cache."""
        if tokens > self.max_context:
            raise CacheFullError(
                f"{what} needs {tokens:,} tokens of cache; the cache holds {self.max_context:,} per sequence"
            )
        if self.pages_for(tokens) > self.num_pages - 1:
            raise CacheFullError(
                f"{what} needs {self.pages_for(tokens):,} pages of {self.page_size} tokens; "
                f"the pool has {self.num_pages - 1:,}"
            )

    def can_admit(self, tokens: int) -> bool:
        return bool(self._free_slots) and self.pages_for(tokens) <= len(self._free_pages)

    def admit(self, tokens: int) -> SequenceAllocation:
        """A slot (states zeroed) and the pages for a sequence that will hold `tokens` tokens."""
        self.check_fits(tokens)
        if not self.can_admit(tokens):
            raise CacheFullError(f"no room for {tokens:,} more tokens now: wait until a sequence is released")
        slot = self._free_slots.pop()
        pages = [self._free_pages.pop() for _ in range(self.pages_for(tokens))]
        for pools in self.pools.values():
            for pool in pools.values():
                pool[slot].zero_()
        row = torch.full((self.max_blocks,), SCRATCH, dtype=torch.int32)
        row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.block_tables[slot].copy_(row)
        return SequenceAllocation(slot, pages)

    def release(self, allocation: SequenceAllocation) -> None:
        self.block_tables[allocation.slot].fill_(SCRATCH)
        self._free_pages.extend(reversed(allocation.pages))
        self._free_slots.append(allocation.slot)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    # -- views for one forward ------------------------------------------------------------------

    def prefill(self, slot: int, start: int, length: int) -> StepCache:
        """One sequence's chunk of tokens start..length-1 (its keys before `start` are cached)."""
        positions = torch.arange(start, length, device=self.device)[None, :]
        slots = torch.tensor([slot], device=self.device)
        table = self.block_tables[slot : slot + 1, : self.pages_for(length)]
        return StepCache(self, False, positions, slots, table, length)

    def decode(self, slots: torch.Tensor, positions: torch.Tensor) -> StepCache:
        """One token per sequence: slots (B,) and positions (B,) on the device (CUDA-graph safe)."""
        return StepCache(self, True, positions[:, None], slots, self.block_tables[slots])
