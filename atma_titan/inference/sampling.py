"""Choosing the next token from the logits: greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atma_titan.utils.errors import InputError

__all__ = ["Sampling", "allowed_tokens", "sample"]


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax); top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise InputError(f"--temperature {self.temperature} is invalid; allowed: >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise InputError(f"--top-k {self.top_k} is invalid; allowed: an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise InputError(f"--top-p {self.top_p} is invalid; allowed: a number in (0, 1] (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def allowed_tokens(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(B, V) bool: the tokens top-k and top-p keep (always at least the most likely one).

    top-p keeps the smallest set of most likely tokens whose probability reaches top_p.
    """
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        keep &= logits >= kth
    if top_p < 1:
        probs, order = logits.masked_fill(~keep, float("-inf")).softmax(-1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        keep_sorted = before < top_p
        keep_sorted[:, 0] = True
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    return keep


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens (B,) for logits (B, V)."""
    if sampling.greedy:
        return logits.argmax(-1)
    logits = logits.float() / sampling.temperature
    keep = allowed_tokens(logits, sampling.top_k, sampling.top_p)
    probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
