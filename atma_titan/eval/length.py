"""Length curve (docs/model.md section 7): mean NLL per token on nested prefixes of the same long documents.

Each document is evaluated as `[EOT] + document[:L_max - 1]` (EOT before each document, as in
training) in ONE forward pass at the longest length L_max. The model is causal, so the losses on
a prefix do not depend on what follows it: the NLL of the prefix of length L is the mean of the
first L - 1 token losses (a prefix of L tokens makes L - 1 next-token predictions) of that single
pass. Every prefix length uses the same documents, so the curve compares lengths, not documents;
each document weighs the same at every length (all have L_max tokens).

The LM head runs on chunks of `head_chunk` positions of the final hidden states, so a 64K-token
document never holds (T x vocab) logits at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from atma_titan.eval.common import EvalInputError, size_label
from atma_titan.inference.context import evaluating

__all__ = ["DEFAULT_LENGTHS", "LengthCurve", "length_curve", "length_sequences", "nested_prefix_nll", "token_losses"]

DEFAULT_LENGTHS = tuple(2048 * 2**i for i in range(6))  # 2K, 4K, ..., 64K
DEFAULT_HEAD_CHUNK = 4096
DEFAULT_BATCH_TOKENS = 1 << 17


@dataclass
class LengthCurve:
    """As written to results.json: {"lengths", "nll", "documents"}."""

    lengths: list[int]
    nll: list[float]
    documents: int

    def as_dict(self) -> dict:
        return {"lengths": list(self.lengths), "nll": list(self.nll), "documents": self.documents}


def token_losses(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    head_chunk: int = DEFAULT_HEAD_CHUNK,
    device: torch.device | None = None,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
) -> torch.Tensor:
    """Next-token losses (B, T - 1), float32 on the CPU, of `tokens` (B, T): loss[t] = -log p(x[t+1] | x[:t+1])."""
    with evaluating(model, autocast_dtype) as model_dev:
        dev = device or model_dev
        tokens = tokens.to(dev)
        hidden, _ = model.trunk(tokens)
        n = tokens.shape[1] - 1
        out = torch.empty(tokens.shape[0], n, dtype=torch.float32)
        for start in range(0, n, head_chunk):
            end = min(start + head_chunk, n)
            logits = model.head(hidden[:, start:end]).float()
            loss = F.cross_entropy(logits.transpose(1, 2), tokens[:, start + 1 : end + 1], reduction="none")
            out[:, start:end] = loss.float().cpu()
        return out


def nested_prefix_nll(losses: torch.Tensor | np.ndarray, lengths: Sequence[int]) -> list[float]:
    """Mean NLL of the prefixes of each length, from per-token losses (documents x positions)."""
    losses = torch.as_tensor(losses, dtype=torch.float64)
    return [float(losses[:, : length - 1].mean()) for length in lengths]


def check_lengths(lengths: Sequence[int]) -> list[int]:
    lengths = sorted(set(int(x) for x in lengths))
    if not lengths or lengths[0] < 2:
        raise EvalInputError(f"length-curve lengths must be >= 2 (a token and its successor), got {lengths}")
    return lengths


def length_sequences(documents, eot_id: int, max_length: int, count: int) -> list[np.ndarray]:
    """`count` sequences `[EOT] + document[:max_length - 1]`, from documents of at least max_length - 1 tokens.

    `documents` is a `LongDocuments` (`get(i, n)`) or a sequence of token arrays.
    """
    out = []
    for i in range(count):
        if hasattr(documents, "get"):
            doc = documents.get(i, max_length - 1)
        else:
            if i >= len(documents):
                raise EvalInputError(f"{count} documents requested, {len(documents)} given")
            doc = documents[i]
        if len(doc) < max_length - 1:
            raise EvalInputError(f"document {i} has {len(doc)} tokens; length {max_length} needs {max_length - 1}")
        out.append(np.concatenate([[eot_id], np.asarray(doc[: max_length - 1], dtype=np.int64)]))
    return out


def length_curve(
    model: nn.Module,
    sequences: Iterable[np.ndarray],
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    *,
    head_chunk: int = DEFAULT_HEAD_CHUNK,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    device: torch.device | None = None,
    progress: Callable[[str], None] | None = print,
) -> LengthCurve:
    """NLL on nested prefixes of `sequences` (each at least max(lengths) tokens, fed at max(lengths))."""
    lengths = check_lengths(lengths)
    longest = lengths[-1]
    sequences = [np.asarray(s[:longest], dtype=np.int64) for s in sequences]
    if not sequences:
        raise EvalInputError("the length curve needs at least one document")
    short = [i for i, s in enumerate(sequences) if len(s) < longest]
    if short:
        raise EvalInputError(f"documents {short} are shorter than the longest length {longest}")
    per_batch = max(1, batch_tokens // longest)
    losses = []
    for start in range(0, len(sequences), per_batch):
        began = time.perf_counter()
        batch = torch.as_tensor(np.stack(sequences[start : start + per_batch]))
        losses.append(token_losses(model, batch, head_chunk=head_chunk, device=device))
        if progress:
            done = min(start + per_batch, len(sequences))
            progress(
                f"length curve: {done}/{len(sequences)} documents of {size_label(longest)} tokens "
                f"({time.perf_counter() - began:.1f} s)"
            )
    nll = nested_prefix_nll(torch.cat(losses), lengths)
    return LengthCurve(lengths=lengths, nll=nll, documents=len(sequences))
