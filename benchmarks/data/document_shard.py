"""A `.bin` shard whose documents have a chosen length distribution, for timing training with documents apart.

    python benchmarks/data/document_shard.py OUT.bin [--tokens 16_000_000] [--docs fineweb] [--seed 0]

The training speed of `data.document_mask` depends on how long the documents are (short ones let the Polar
kernel skip tiles), and the built-in synthetic source's documents are short (64 tokens on average). This
writes an llm.c shard (GPT-2 ids, EOT before each document, data/shards.py) whose document lengths follow
`--docs` (benchmarks.common.SAMPLERS: `1k`, or `fineweb`, a FineWeb-Edu-like heavy tail) and whose tokens
are uniform random ids: the speed of a step does not depend on which ids it reads. Train on it with
`--data.source bin --data.path OUT.bin --data.tokenizer gpt2`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.data.shards import write_shard  # noqa: E402
from atma_titan.data.tokenizer import GPT2Tokenizer  # noqa: E402
from benchmarks.common import SAMPLERS, document_lengths  # noqa: E402


def document_tokens(tokens: int, docs: str, seed: int) -> np.ndarray:
    """`tokens` random GPT-2 ids with the EOT id at the start of each `docs`-distributed document."""
    eot = GPT2Tokenizer.eot_id
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, eot, size=tokens, dtype=np.int64)
    lengths = document_lengths(docs, tokens, torch.Generator().manual_seed(seed)).numpy()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ids[starts[starts < tokens]] = eot
    return ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the shard to write (.bin)")
    parser.add_argument("--tokens", type=int, default=16_000_000, help="tokens in the shard (default 16M)")
    parser.add_argument("--docs", default="fineweb", choices=[k for k, v in SAMPLERS.items() if v is not None])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    ids = document_tokens(args.tokens, args.docs, args.seed)
    write_shard(args.out, ids)
    documents = int((ids == GPT2Tokenizer.eot_id).sum())
    mean = len(ids) / documents
    print(f"wrote {args.out}: {len(ids):,} tokens, {documents:,} {args.docs} documents ({mean:,.0f} tokens a document)")


if __name__ == "__main__":
    main()
