"""Document boundaries inside packed sequences: the one form every kernel takes, and what each derives from it.

A packed training window holds several documents. The kernels take their boundaries as `doc_start`, an
integer tensor (B, T): for each position t of sequence b, the position where t's document begins, so

    0 <= doc_start[b, t] <= t,   doc_start[b, 0] = 0,   doc_start[b, t] in {t, doc_start[b, t - 1]}.

A document begins at t exactly when doc_start[b, t] == t. `None` everywhere means one document per
sequence: the kernels then run their code paths of before, unchanged.

Why this form and not `cu_seqlens` over a flattened batch (fla, FlashAttention varlen): it has the
batch's static shape (B, T), so torch.compile sees no new shapes when a batch holds more or fewer
documents, FSDP2 and activation checkpointing pass it along like any other input, and each mixer reads
what it needs locally: attention's key range for a query (doc_start[t] .. t), the convolution's reach
(t - doc_start[t]), the memory's resets (doc_start[t] == t). `cu_seqlens` is derived where a library
wants it (fla, `cu_seqlens`).
"""

from __future__ import annotations

import torch

__all__ = [
    "check_doc_start",
    "cu_seqlens",
    "doc_start_from_flags",
    "document_ends",
    "document_resets",
    "positions_in_document",
]


def check_doc_start(doc_start: torch.Tensor | None, batch: int, length: int, name: str = "doc_start") -> None:
    """Shape and dtype of a doc_start for (batch, length) sequences; the values are not read (no device sync)."""
    if doc_start is None:
        return
    if doc_start.shape != (batch, length):
        raise ValueError(f"{name} must have shape ({batch}, {length}), got {tuple(doc_start.shape)}")
    if doc_start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an integer tensor (int32), got {doc_start.dtype}")


def doc_start_from_flags(starts: torch.Tensor) -> torch.Tensor:
    """int32 doc_start (B, T) from bool flags (B, T) that are True where a document begins; position 0
    always begins one (a window may open in the middle of a document)."""
    positions = torch.arange(starts.shape[-1], device=starts.device, dtype=torch.int32).expand_as(starts)
    marked = torch.where(starts, positions, torch.zeros_like(positions))
    return marked.cummax(dim=-1).values


def positions_in_document(doc_start: torch.Tensor) -> torch.Tensor:
    """t - doc_start[t]: each token's position in its own document (0 at its first token)."""
    return torch.arange(doc_start.shape[-1], device=doc_start.device, dtype=doc_start.dtype) - doc_start


def document_resets(doc_start: torch.Tensor) -> torch.Tensor:
    """bool (B, T): a document begins at t > 0 (position 0 continues whatever came before the window)."""
    resets = positions_in_document(doc_start) == 0
    resets[..., :1] = False  # (a slice: an empty window has no position 0)
    return resets


def document_ends(doc_start: torch.Tensor) -> torch.Tensor:
    """int32 (B, T): the exclusive end of each token's document (the next document's start, or T)."""
    length = doc_start.shape[-1]
    positions = torch.arange(length, device=doc_start.device, dtype=torch.int32)
    begins = positions_in_document(doc_start) == 0
    # the start of the next document after t: the first begin at a position > t
    next_begin = torch.where(begins, positions.expand_as(begins), torch.full_like(begins, length, dtype=torch.int32))
    next_begin = torch.cat([next_begin[..., 1:], next_begin.new_full((*next_begin.shape[:-1], 1), length)], dim=-1)
    return next_begin.flip(-1).cummin(dim=-1).values.flip(-1)


def cu_seqlens(doc_start: torch.Tensor) -> torch.Tensor:
    """int32 (N + 1,): the boundaries of the N documents of the whole batch flattened to one sequence of B * T
    tokens (each sequence's position 0 begins a document), as fla's varlen kernels take them."""
    batch, length = doc_start.shape
    begins = (positions_in_document(doc_start) == 0).flatten()
    starts = torch.nonzero(begins).flatten().to(torch.int32)
    return torch.cat([starts, starts.new_full((1,), batch * length)])
