"""Packed documents for the document-mask tests: a doc_start from document lengths or starts, and the spans."""

import torch

from atma_titan.kernels.documents import doc_start_from_flags


def doc_start_from_lengths(lengths: list[list[int]]) -> torch.Tensor:
    """int32 doc_start (B, T) for sequences whose documents have these lengths (each row sums to T)."""
    length = sum(lengths[0])
    assert all(sum(row) == length for row in lengths), "each sequence's documents must fill it"
    return doc_start_from_starts(length, *(torch.tensor([0, *row[:-1]]).cumsum(0).tolist() for row in lengths))


def doc_start_from_starts(tk, *starts):
    """int32 doc_start (B, Tk) of B packed sequences; starts[b] lists where sequence b's documents begin
    (position 0 always begins one)."""
    flags = torch.zeros(len(starts), tk, dtype=torch.bool)
    for b, row in enumerate(starts):
        flags[b, list(row)] = True
    return doc_start_from_flags(flags)


def document_spans(doc_start: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per sequence, the (first, end) positions of its documents."""
    length = doc_start.shape[1]
    spans = []
    for row in doc_start.tolist():
        begins = [t for t in range(length) if row[t] == t]
        spans.append(list(zip(begins, [*begins[1:], length])))
    return spans
