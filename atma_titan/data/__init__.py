"""Data: tokenizers, token sources, and the loaders that split them across data-parallel ranks.

Two kinds of source feed training:
- random access (`window(i, length)`): the built-in synthetic source and llm.c `.bin` shards. The
  global window stream is split per step across ranks, and its position is one number, so resume
  is exact at any world size and any number of loader workers;
- streaming documents (text files, Hugging Face datasets): tokenised and packed on the fly, split
  by file (or document) across ranks x workers. Resume is exact at the same world size and worker
  count; at another, the stream continues from the global document cursor (`StreamCursor`, saved
  in the checkpoint's global state): no trained document is read again, and at most the
  untrained rest of one document per old rank x worker is skipped (see `stream_plan`, `packing`).

build.py opens the `[data]` section (`TrainData`, the source builders); the other modules hold the
sources (synthetic, shards, documents), the tokenizers, the loaders and the `prepare` command.
"""

from atma_titan.data.build import (
    DataConfigError,
    StreamCursor,
    TrainData,
    build_document_source,
    build_source,
    check_vocab,
)
from atma_titan.data.synthetic import SyntheticSource
from atma_titan.data.tokenizer import build_tokenizer

__all__ = [
    "DataConfigError",
    "StreamCursor",
    "SyntheticSource",
    "TrainData",
    "build_document_source",
    "build_source",
    "build_tokenizer",
    "check_vocab",
]
