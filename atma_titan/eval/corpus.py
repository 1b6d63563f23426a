"""Evaluation text: the synthetic passkey filler, and long documents from the run's data.

Haystacks and length-curve documents are token arrays. Three kinds of data give documents:

* text / Hugging Face sources (`atma_titan.data.documents.TextFiles` / `HFDataset`): each document
  is tokenised on its own, one pass over the source (part 0 of 1), in source order;
* llm.c `.bin` shards: the runs of tokens between EOT markers (EOT comes before each document);
* the built-in synthetic source: its windows, from a held-out index range (training starts at
  window 0 and never reaches 2**40), each window one "document" (it packs many short synthetic
  documents; the synthetic language has no long ones).

`LongDocuments` picks the documents long enough for a request, in source order, and caches them,
so trial i of every gap reads the i-th document long enough for that gap. When no document is
long enough it raises `EvalInputError`, unless `allow_concat` is set: then the i-th haystack is
documents i, i+1, ... joined with EOT.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np

from atma_titan.eval.common import EvalInputError

__all__ = [
    "FILLER",
    "FillerHaystack",
    "DocumentHaystack",
    "LongDocuments",
    "TokenCorpus",
    "corpus_from_config",
    "filler_tokens",
    "shard_documents",
    "synthetic_documents",
    "text_documents",
]

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SYNTHETIC_HELD_OUT_WINDOW = 1 << 40  # first window index used for evaluation: far past any training run
MAX_SCANNED_DOCUMENTS = 1_000_000  # a text/HF scan for long documents stops here (a full pass may be huge)
_SHARD_CHUNK = 1 << 22  # tokens read per step while splitting shards at EOT


def filler_tokens(tokenizer, n_tokens: int) -> np.ndarray:
    """`n_tokens` tokens of " " + FILLER repeated; the unit is tokenised once, so every copy is identical."""
    unit = np.asarray(tokenizer.encode(" " + FILLER), dtype=np.int64)
    return np.tile(unit, -(-n_tokens // len(unit)))[:n_tokens]


# ---------------------------------------------------------------------------------------------
# Document token streams: one pass, in source order; a too-short document may come as an empty
# array (it still counts as scanned) so a text source need not tokenise what cannot qualify.
# ---------------------------------------------------------------------------------------------


def text_documents(source, tokenizer, min_tokens: int, max_tokens: int) -> Iterator[np.ndarray]:
    """Tokenised documents of one pass over a `DocumentSource` (part 0 of 1), cut to `max_tokens`."""
    for scanned, (text, state) in enumerate(source.documents(0, 1)):
        if state.get("epoch", 0) > 0 or scanned >= MAX_SCANNED_DOCUMENTS:
            return
        # A token covers at least one UTF-8 byte (byte-level BPE, byte fallback): short texts cannot qualify.
        if len(text) * 4 < min_tokens or len(text.encode("utf-8")) + 8 < min_tokens:
            yield np.empty(0, dtype=np.int64)
            continue
        yield np.asarray(tokenizer.encode(text)[:max_tokens], dtype=np.int64)


def _stream_chunks(shards) -> Iterator[np.ndarray]:
    """The shards' token stream, shard by shard, in chunks of at most _SHARD_CHUNK tokens (ranged reads)."""
    import fsspec

    from atma_titan.data.shards import ShardError

    for header in shards.headers:
        fs, fspath = fsspec.core.url_to_fs(header.path)
        width = header.dtype.itemsize
        for start in range(0, header.num_tokens, _SHARD_CHUNK):
            end = min(start + _SHARD_CHUNK, header.num_tokens)
            raw = fs.cat_file(fspath, header.header_bytes + start * width, header.header_bytes + end * width)
            chunk = np.frombuffer(raw, dtype=header.dtype).astype(np.int64)
            if shards.vocab_size is not None and len(chunk) and int(chunk.max()) >= shards.vocab_size:
                raise ShardError(
                    f"{header.path}: token id {int(chunk.max())} is >= model.vocab_size {shards.vocab_size}: "
                    "the shards were made with another tokenizer"
                )
            yield chunk


def shard_documents(shards, eot_id: int, min_tokens: int, max_tokens: int) -> Iterator[np.ndarray]:
    """The EOT-separated documents of llm.c shards, cut to `max_tokens` (shorter ones come empty)."""
    pieces: list[np.ndarray] = []
    length = 0  # tokens of the current document so far (counted past max_tokens, kept up to it)

    def finish() -> np.ndarray:
        if length < max(min_tokens, 1):
            return np.empty(0, dtype=np.int64)
        return np.concatenate(pieces).astype(np.int64)[:max_tokens]

    for chunk in _stream_chunks(shards):
        start = 0
        for end in np.flatnonzero(chunk == eot_id).tolist() + [None]:
            piece = chunk[start:end]
            if length < max_tokens:
                pieces.append(piece[: max_tokens - length])
            length += len(piece)
            if end is None:
                break
            if length:  # two EOTs in a row delimit nothing
                yield finish()
            pieces, length, start = [], 0, end + 1
    if length:
        yield finish()


def synthetic_documents(source, max_tokens: int) -> Iterator[np.ndarray]:
    """Held-out windows of the synthetic source, each `max_tokens` long after its leading EOT."""
    index = SYNTHETIC_HELD_OUT_WINDOW
    while True:
        yield source.window(index, max_tokens + 1)[1:]
        index += 1


@dataclass
class TokenCorpus:
    """A named source of documents: `open(min_tokens, max_tokens)` starts a fresh pass."""

    describe: str
    open: Callable[[int, int], Iterator[np.ndarray]]
    eot_id: int


def corpus_from_config(data_cfg, tokenizer, vocab_size: int) -> TokenCorpus:
    """The evaluation documents of a run's `[data]` section: `val_path` when set, else `path`."""
    if data_cfg.source == "synthetic":
        from atma_titan.data.synthetic import SyntheticSource

        source = SyntheticSource(vocab_size, eot_id=tokenizer.eot_id, seed=data_cfg.seed)
        return TokenCorpus(
            f"synthetic windows (seed {data_cfg.seed}, held-out indices from 2**40)",
            lambda lo, hi: synthetic_documents(source, hi),
            tokenizer.eot_id,
        )
    path = data_cfg.val_path or data_cfg.path
    if not path:
        raise EvalInputError(f"data.source = '{data_cfg.source}' but neither data.val_path nor data.path is set")
    if data_cfg.source == "bin":
        from atma_titan.data.shards import BinShards

        shards = BinShards(path, vocab_size=vocab_size)
        return TokenCorpus(
            f".bin shards {path!r}", lambda lo, hi: shard_documents(shards, tokenizer.eot_id, lo, hi), tokenizer.eot_id
        )
    from atma_titan.data import build_document_source

    source = build_document_source(replace(data_cfg, path=path))
    return TokenCorpus(
        f"{data_cfg.source} documents {path!r}",
        lambda lo, hi: text_documents(source, tokenizer, lo, hi),
        tokenizer.eot_id,
    )


class LongDocuments:
    """Documents of at least n tokens in source order, found lazily (one pass) and cached.

    `get(i, n)` is the i-th document with at least n tokens (cut to `max_tokens`); with
    `allow_concat` it is documents i, i+1, ... of the source joined with EOT, cut to n.
    `min_tokens` is the shortest request that will be made: shorter documents are not kept.
    """

    def __init__(self, corpus: TokenCorpus, *, min_tokens: int, max_tokens: int, allow_concat: bool = False):
        self.corpus, self.allow_concat = corpus, allow_concat
        self.min_tokens, self.max_tokens = min_tokens, max(max_tokens, min_tokens)
        self._stream = corpus.open(0 if allow_concat else min_tokens, self.max_tokens)
        self._kept: list[np.ndarray] = []
        self._scanned = 0
        self._exhausted = False

    def get(self, index: int, n_tokens: int) -> np.ndarray:
        if n_tokens > self.max_tokens:
            raise ValueError(f"asked for {n_tokens} tokens but documents are cut to max_tokens={self.max_tokens}")
        return self._joined(index, n_tokens) if self.allow_concat else self._long(index, n_tokens)

    def _long(self, index: int, n_tokens: int) -> np.ndarray:
        found = [d for d in self._kept if len(d) >= n_tokens]
        while len(found) <= index and self._pull():
            if len(self._kept[-1]) >= n_tokens:
                found.append(self._kept[-1])
        if len(found) <= index:
            raise EvalInputError(
                f"{self.corpus.describe}: only {len(found)} document(s) of at least {n_tokens:,} tokens in the "
                f"{self._scanned:,} scanned, but {index + 1} are needed (one per trial or document). Use fewer "
                "trials/documents or shorter gaps/lengths, point data.val_path at data with longer documents, "
                "or join documents with EOT (--allow-concat)"
            )
        return found[index]

    def _joined(self, index: int, n_tokens: int) -> np.ndarray:
        eot = np.array([self.corpus.eot_id], dtype=np.int64)
        pieces, total, k = [], 0, index
        while total < n_tokens:
            while k >= len(self._kept) and self._pull():
                pass
            if k >= len(self._kept):
                raise EvalInputError(
                    f"{self.corpus.describe}: documents {index} onwards hold fewer than {n_tokens:,} tokens even "
                    f"joined with EOT ({self._scanned:,} documents in all); use fewer trials or shorter gaps/lengths"
                )
            if pieces:
                pieces.append(eot)
            pieces.append(self._kept[k])
            total = sum(len(p) for p in pieces)
            k += 1
        return np.concatenate(pieces)[:n_tokens]

    def _pull(self) -> bool:
        """Read documents until one is kept; False once the source is exhausted."""
        while not self._exhausted:
            doc = next(self._stream, None)
            if doc is None:
                self._exhausted = True
                break
            self._scanned += 1
            if len(doc) and (self.allow_concat or len(doc) >= self.min_tokens):
                self._kept.append(doc[: self.max_tokens])
                return True
        return False


class FillerHaystack:
    """The synthetic passkey filler: the same text for every trial."""

    describe = "passkey filler"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def tokens(self, trial: int, n_tokens: int) -> np.ndarray:
        return filler_tokens(self.tokenizer, n_tokens)


class DocumentHaystack:
    """Real text: trial i's haystack is the i-th document long enough for the request."""

    def __init__(self, documents: LongDocuments):
        self.documents = documents
        self.describe = documents.corpus.describe

    def tokens(self, trial: int, n_tokens: int) -> np.ndarray:
        return self.documents.get(trial, n_tokens)
