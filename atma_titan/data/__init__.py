"""Data: tokenizers, token sources, and the loader that splits one global stream across ranks."""

from __future__ import annotations

from atma_titan.data.synthetic import SyntheticSource
from atma_titan.data.tokenizer import build_tokenizer


def build_source(cfg, vocab_size: int):
    """The token source named by `[data] source`, producing ids below the model's `vocab_size`."""
    if cfg.source == "synthetic":
        tokenizer = build_tokenizer(cfg.tokenizer)
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(
                f"tokenizer '{cfg.tokenizer}' has {tokenizer.vocab_size} ids but model.vocab_size is "
                f"{vocab_size}; raise model.vocab_size or pick a smaller tokenizer"
            )
        return SyntheticSource(vocab_size, eot_id=tokenizer.eot_id, seed=cfg.seed)
    raise ValueError(f"'data.source' = {cfg.source!r} is unknown; allowed: synthetic")
