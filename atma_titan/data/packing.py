"""Packing tokenised documents into training windows, and the streaming per-rank batch dataset.

Layout (llm.c convention, the same as the .bin shard source): documents are joined into one
token stream with the EOT id *before* each document, and window ``k`` of length ``L``
(``seq_len + 1``) covers stream tokens ``k*(L-1) .. k*(L-1) + L-1``, so consecutive windows
share one boundary token and every token after the first is a label exactly once::

    stream   EOT a a a EOT b b b b b EOT c c ...
    k = 0    EOT a a a EOT                        (L = 5)
    k = 1                EOT b b b b
    k = 2                        b b EOT c c

``doc_start_mask`` is True at the positions holding a document's leading EOT (for
document masking later). The tokens after the last full window are the *carry*: they
start the next window when more documents arrive (or after a restore).

``PackedBatches`` streams one rank's micro-batches ``(inputs, labels)``, each ``(b, seq_len)``
int64 with ``labels`` = ``inputs`` shifted by one, like ``loader.RankBatches``. Documents are
split by *part*: part = rank * num_workers + worker of num_parts = world_size * num_workers,
so every rank and loader worker packs its own disjoint documents (the source's split under a
``stream_plan.StreamPlan``); the loader takes workers in turn.

State per worker (plain lists, dicts and ints): the document source's position after the last
document that went into the packer, the carry, and the source position *before* each document
that starts in the carry. Documents read ahead for batched tokenisation are not part of the
state: after a restore they are read again from the source. A restore of that state needs the
same world size and worker count (it is refused otherwise) and the plan saved with it; it
continues bit for bit.

The global cursor (``consumed_positions``): a document counts as *consumed* once its leading
EOT has been an input token of a window this loader handed out, i.e. once it starts before
the carry (the carry's first token was only a label of the last window). Each part's consumed
position is the position before the first document that starts in the carry, or after the last
document packed when none does. Folded into the plan (``StreamPlan.advanced``) these give the
cursor a run continues from at another world size or worker count: the documents starting in
the carry are read again there (no token of theirs was trained but, at most, the leading EOT as
the last label of a window), and the only text lost is the untrained rest of each part's last
consumed document: at most one document per part, at most that document's length less one token.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader.stateful_dataloader import _DATASET_STATE
from torchdata.stateful_dataloader.stateful_dataloader import _StatefulMultiProcessingDataLoaderIter as _WorkersIter

from atma_titan.data.documents import DocumentSource
from atma_titan.data.loader import stateful_loader
from atma_titan.data.stream_plan import StreamPlan
from atma_titan.data.tokenizer import Tokenizer, encode_batch

__all__ = ["Packer", "PartWindows", "pack", "PackedBatches", "build_text_dataloader", "consumed_positions"]


class Packer:
    """Incremental packer: add documents, take windows of ``length`` tokens as they fill up.

    ``carry`` / ``carry_doc_starts`` (offsets of document-start EOTs within ``carry``) are the
    tokens not yet emitted as the start of a window; give them to a new ``Packer`` to continue.
    """

    def __init__(
        self,
        length: int,
        eot_id: int,
        carry: Iterable[int] | None = None,
        carry_doc_starts: Iterable[int] | None = None,
    ):
        if length < 2:
            raise ValueError(f"window length must be >= 2 (windows share one token), got {length}")
        self.length, self.eot_id = int(length), int(eot_id)
        self._tokens = np.asarray(list(carry) if carry is not None else [], dtype=np.int64)
        self._starts = np.zeros(len(self._tokens), dtype=bool)
        if carry_doc_starts is None:  # a carry from pack(): its EOTs are the document starts
            self._starts[self._tokens == self.eot_id] = True
        else:
            self._starts[np.asarray(list(carry_doc_starts), dtype=np.int64)] = True
        self._pending: list[np.ndarray] = []  # documents added since the last concatenation
        self._pending_len = 0

    def add_document(self, tokens) -> None:
        """Append EOT + ``tokens`` to the stream."""
        doc = np.empty(len(tokens) + 1, dtype=np.int64)
        doc[0] = self.eot_id
        doc[1:] = tokens
        self._pending.append(doc)
        self._pending_len += len(doc)

    def available(self) -> int:
        return len(self._tokens) + self._pending_len

    def next_window(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The next (window int64 [length], doc_start_mask bool [length]), or None until more documents arrive."""
        if self.available() < self.length:
            return None
        if len(self._tokens) < self.length:
            self._merge_pending()
        window, mask = self._tokens[: self.length], self._starts[: self.length]
        # Keep the last token: it is also the first token of the next window.
        self._tokens, self._starts = self._tokens[self.length - 1 :], self._starts[self.length - 1 :]
        return window, mask

    def _merge_pending(self) -> None:
        # One concatenation per window at most, however many short documents arrived.
        starts = [self._starts]
        for doc in self._pending:
            doc_starts = np.zeros(len(doc), dtype=bool)
            doc_starts[0] = True
            starts.append(doc_starts)
        self._tokens = np.concatenate([self._tokens, *self._pending])
        self._starts = np.concatenate(starts)
        self._pending, self._pending_len = [], 0

    @property
    def carry(self) -> list[int]:
        self._merge_pending()
        return self._tokens.tolist()

    @property
    def carry_doc_starts(self) -> list[int]:
        self._merge_pending()
        return np.flatnonzero(self._starts).tolist()


def pack(
    token_docs: Iterable[list[int]],
    length: int,
    eot_id: int,
    carry: list[int] | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Windows ``(tokens int64 [length], doc_start_mask bool [length])`` of the documents, EOT before each.

    ``carry`` is a previous stream's unemitted tail (its EOT ids count as document starts);
    a final partial window is not emitted. See the module docstring for the layout.
    """
    packer = Packer(length, eot_id, carry)
    for tokens in token_docs:
        packer.add_document(tokens)
        while (window := packer.next_window()) is not None:
            yield window


def _worker_slot() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class _Stream:
    """One running iteration: its part, packer, source position and the positions of the documents in the carry."""

    def __init__(self, part: int, num_parts: int, packer: Packer, source: dict | None, carry_positions: list):
        self.part, self.num_parts, self.packer, self.source = part, num_parts, packer, source
        self.carry_positions = deque(carry_positions)  # position before each document starting in the carry

    def add(self, tokens, position_after: dict) -> None:
        self.carry_positions.append(self.source)
        self.packer.add_document(tokens)
        self.source = position_after

    def window(self) -> np.ndarray | None:
        taken = self.packer.next_window()
        if taken is None:
            return None
        window, starts = taken
        for _ in range(int(starts[:-1].sum())):  # documents whose EOT was an input: consumed
            self.carry_positions.popleft()
        return window

    def consumed(self) -> dict | None:
        return self.carry_positions[0] if self.carry_positions else self.source

    def state(self) -> dict:
        return {
            "part": self.part,
            "num_parts": self.num_parts,
            "source": self.source,
            "carry": self.packer.carry,
            "carry_doc_starts": self.packer.carry_doc_starts,
            "carry_positions": list(self.carry_positions),
            "consumed": self.consumed(),
        }


class PackedBatches(IterableDataset):
    """This rank's micro-batches of packed documents, as (inputs, labels), each (b, seq_len) int64.

    See the module docstring for the split and the state. ``tokenize_batch`` documents are
    read and tokenised together (the tokenizers are faster in batch). ``plan`` is the stream
    plan the parts read under (None: the source's fresh plan).
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        seq_len: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        tokenize_batch: int = 64,
        plan: StreamPlan | None = None,
    ):
        if seq_len < 1 or micro_batch < 1 or tokenize_batch < 1:
            raise ValueError(
                f"seq_len, micro_batch and tokenize_batch must be >= 1, got {seq_len}, {micro_batch}, {tokenize_batch}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank {rank} of {world_size}")
        self.source, self.tokenizer, self.plan = source, tokenizer, plan
        self.seq_len, self.micro_batch, self.tokenize_batch = seq_len, micro_batch, tokenize_batch
        self.rank, self.world_size = rank, world_size
        self._loaded: dict | None = None  # a state to start from (load_state_dict), until iteration starts
        self._live: PartWindows | None = None  # the running iteration

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Where this worker's stream stands after the last batch it yielded."""
        if self._live is not None:
            return self._live.state()
        return dict(self._loaded) if self._loaded is not None else dict(PartWindows.FRESH)

    def load_state_dict(self, state: dict) -> None:
        self._loaded, self._live = dict(state), None

    # ------------------------------------------------------------------ iteration

    def __iter__(self):
        worker, num_workers = _worker_slot()
        part, num_parts = self.rank * num_workers + worker, self.world_size * num_workers
        start = self.state_dict()  # a loaded state, or where the previous iteration stopped
        check_part_state(start, part, num_parts)
        windows = PartWindows(self.source, self.tokenizer, self.seq_len + 1, part, num_parts, self.plan, start,
                              self.tokenize_batch)  # fmt: skip
        self._live, self._loaded = windows, None
        rows: list[np.ndarray] = []
        while (window := windows.next()) is not None:
            rows.append(window)
            if len(rows) == self.micro_batch:
                tokens = torch.from_numpy(np.stack(rows))
                rows = []
                yield tokens[:, :-1], tokens[:, 1:]


def check_part_state(state: dict, part: int, num_parts: int) -> None:
    """Refuse a part's saved state that another split (world size x loader workers) wrote."""
    saved = (state.get("part", part), state.get("num_parts", num_parts))
    if saved != (part, num_parts):
        raise ValueError(
            f"loader state was saved by part {saved[0]} of {saved[1]} (rank x loader worker); this is part "
            f"{part} of {num_parts}: restore it with the same world size and num_workers (at another, "
            "start from the stream plan instead)"
        )
    source = state.get("source")
    if (source is not None and "unit" not in source) or (state["carry"] and "carry_positions" not in state):
        raise ValueError(
            f"loader state {source} was written by an older atma_titan (files split without a stream plan); "
            "it cannot be restored"
        )


def _tokenized(documents: Iterator[tuple[str, dict]], tokenizer: Tokenizer, batch: int):
    """(tokens, source state after the document), tokenising `batch` documents per call."""
    while True:
        texts, states = [], []
        for text, state in documents:
            texts.append(text)
            states.append(state)
            if len(texts) == batch:
                break
        if not texts:
            return  # a finite source ran out (DocumentSources normally do not)
        yield from zip(encode_batch(tokenizer, texts), states)


class PartWindows:
    """One part's packed windows of one document source, from a saved part state (or a fresh one).

    ``next()`` is the next window of ``length`` tokens (None when a finite source runs out); ``state()``
    where the part stands after it (the module docstring's per-worker state)."""

    FRESH = {"source": None, "carry": []}

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        length: int,
        part: int,
        num_parts: int,
        plan: StreamPlan | None,
        state: dict | None = None,
        tokenize_batch: int = 64,
    ):
        state = state or self.FRESH
        packer = Packer(length, tokenizer.eot_id, state["carry"], state.get("carry_doc_starts"))
        self.stream = _Stream(part, num_parts, packer, state["source"], state.get("carry_positions", []))
        # A generator: nothing is read before the first next().
        documents = source.documents(part, num_parts, state["source"], plan=plan)
        self.tokenized = _tokenized(documents, tokenizer, tokenize_batch)

    def next(self) -> np.ndarray | None:
        while (window := self.stream.window()) is None:
            document = next(self.tokenized, None)
            if document is None:
                return None
            # The state moves only with documents that reached the packer, not the ones read ahead.
            self.stream.add(*document)
        return window

    def state(self) -> dict:
        return self.stream.state()


def _dataset_states(loader) -> list[dict]:
    """The PackedBatches state of each loader worker (of the main process without workers), from the loader's own
    state: with workers, torchdata keeps each worker's last snapshot, taken right after the batch it yielded."""
    state = loader.state_dict()
    if loader.num_workers == 0:
        return [state[_DATASET_STATE]] if state.get(_DATASET_STATE) is not None else []
    # torchdata's own key names (imported, so a rename fails loudly instead of losing the positions).
    workers = state.get(_WorkersIter._SNAPSHOT, {}).get(_WorkersIter._WORKER_SNAPSHOTS, {})
    return [w[_DATASET_STATE] for w in workers.values() if w.get(_DATASET_STATE) is not None]


def consumed_positions(loader) -> dict[int, dict | None]:
    """part -> consumed position (module docstring) for each part of this loader that has started."""
    return {s["part"]: s["consumed"] for s in _dataset_states(loader) if "consumed" in s}


def build_text_dataloader(
    source: DocumentSource,
    tokenizer: Tokenizer,
    seq_len: int,
    micro_batch: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
    tokenize_batch: int = 64,
    plan: StreamPlan | None = None,
):
    """A torchdata StatefulDataLoader over this rank's packed micro-batches; its state_dict() resumes it exactly."""
    dataset = PackedBatches(source, tokenizer, seq_len, micro_batch, rank, world_size, tokenize_batch, plan)
    return stateful_loader(dataset, num_workers, pin_memory)
