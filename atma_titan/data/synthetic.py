"""Built-in synthetic pretraining data: a Zipfian token "language" with planted recall.

Why this exists: a debug run on a laptop CPU should need no download and still learn
something measurable. The stream mixes two signals:

* filler text: "words" of 1-4 content tokens from a fixed lexicon, drawn i.i.d. from a Zipf
  distribution over the lexicon, so unigram statistics take the loss well below
  ``log(vocab_size)`` and within-word continuations (learnable by the local convolution
  blocks) take it further;
* associative-recall records ``MARK k_1..k_K v_1..v_V`` whose key and value tokens are
  uniform random, each planted twice in the same document: the value tokens of the
  second occurrence are predictable *only* by looking back at the first one. Their
  positions are reported by ``recall_mask`` so training and eval can measure recall.

Layout of a window (llm.c convention: EOT *before* each document)::

    EOT d0 d0 d0 ... EOT d1 d1 ... EOT d2 d2 d2 d2 d2 ...   (last document is cut off)

Each window is generated independently as such a sequence of documents; there is no
stream state. ``window(i, L)`` is a pure function of ``(seed, i, L)`` and the
constructor arguments, computed from its own counter-based RNG
(``Philox(key=(seed, i))``), so a loader can resume at any window index, skip ahead,
or shard windows across any number of data-parallel ranks without coordination.
Resumability therefore lives in the loader (which holds the next window index), not
here.

The Zipf rank -> token-id assignment is fixed for a given vocabulary (it does not
depend on ``seed``), so two sources that differ only in ``seed`` speak the same
language: a different seed (or a disjoint index range) is a valid held-out split.

Special ids (never used as filler, key or value tokens):

* ``eot_id``: ``vocab_size - 1`` unless given (e.g. 256 for the byte tokenizer).
* ``mark_id``: the largest id below ``vocab_size`` that is not ``eot_id``.

Recall mask and next-token prediction: ``recall_mask(i, L)[p]`` is True when *token*
``p`` is a value token of a repeated record. With the usual shift
``inputs = w[:-1]``, ``labels = w[1:]``, the label at position ``p`` of ``w`` is
predicted from the model output at position ``p - 1``; so the mask that selects the
recall labels is ``recall_mask(i, L)[1:]`` (aligned with ``labels``). Position 0 is
always EOT, never masked.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

__all__ = ["SyntheticSource"]

# Fixed Philox key for the Zipf rank -> id permutation: the "language" must not change
# with the seed, otherwise a different-seed validation split would be a different task.
_LANGUAGE_KEY = 0x41544D41_5A495046  # "ATMA" "ZIPF"
_MAX_UINT64 = 2**64


def _choose_special_ids(vocab_size: int, eot_id: int | None) -> tuple[int, int]:
    """Return (eot_id, mark_id): EOT defaults to the top id, MARK takes the top free id."""
    if eot_id is None:
        eot_id = vocab_size - 1
    mark_id = vocab_size - 1 if eot_id != vocab_size - 1 else vocab_size - 2
    return eot_id, mark_id


def _zipf_cdf(num_ranks: int, exponent: float) -> np.ndarray:
    """Cumulative distribution of P(rank r) proportional to 1 / (r + 1) ** exponent."""
    weights = 1.0 / np.arange(1, num_ranks + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def _make_lexicon(
    rng: np.random.Generator, rank_to_id: np.ndarray, exponent: float, max_word_len: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """A fixed lexicon: (words, max_word_len) token matrix and each word's length (1..max_word_len).

    Word tokens are Zipf-distributed over the content ids, so frequent tokens recur across words
    and a word's first token does not give the rest away: continuations are learnable, not trivial.
    """
    num_words = min(4 * len(rank_to_id), 8192)
    lengths = rng.integers(1, max_word_len + 1, size=num_words)
    ranks = np.searchsorted(_zipf_cdf(len(rank_to_id), exponent), rng.random((num_words, max_word_len)), side="right")
    np.minimum(ranks, len(rank_to_id) - 1, out=ranks)
    return rank_to_id[ranks], lengths


def _check_uint64(name: str, value: int) -> int:
    value = int(value)
    if not 0 <= value < _MAX_UINT64:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    return value


class SyntheticSource:
    """Random-access source of synthetic token windows (see module docstring).

    Args:
        vocab_size: number of token ids; every emitted id is ``< vocab_size``.
            At least 4 (two specials plus a content vocabulary of two or more).
        eot_id: id of the end-of-text token placed before each document; defaults to
            ``vocab_size - 1``. Pass the tokenizer's EOT (e.g. 256 for ``byte``).
        seed: selects the sampled stream; the language itself does not change.
        mean_doc_len: mean document length in tokens, EOT included. Lengths are
            ``min_doc_len + Geometric - 1``, so the mean is exact and long documents
            (long-range recall) occur. Keep it a fraction of the window length so
            windows contain several document boundaries.
        min_doc_len: shortest document, EOT included (>= 2).
        zipf_exponent: filler distribution exponent ``s`` in ``P(rank r) ~ r**-s``.
        key_len: tokens per recall key.
        value_len: tokens per recall value.
        record_fraction: approximate fraction of each document's tokens taken by
            recall records (both occurrences, MARK included); 0 disables recall.
    """

    def __init__(
        self,
        vocab_size: int,
        eot_id: int | None = None,
        seed: int = 0,
        *,
        mean_doc_len: int = 64,
        min_doc_len: int = 8,
        zipf_exponent: float = 1.1,
        key_len: int = 2,
        value_len: int = 2,
        record_fraction: float = 0.3,
    ) -> None:
        if vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
        if eot_id is not None and not 0 <= eot_id < vocab_size:
            raise ValueError(f"eot_id must be in [0, {vocab_size}), got {eot_id}")
        if min_doc_len < 2:
            raise ValueError(f"min_doc_len must be >= 2 (EOT plus one token), got {min_doc_len}")
        if mean_doc_len < min_doc_len:
            raise ValueError(f"mean_doc_len ({mean_doc_len}) must be >= min_doc_len ({min_doc_len})")
        if zipf_exponent <= 0:
            raise ValueError(f"zipf_exponent must be > 0, got {zipf_exponent}")
        if key_len < 1 or value_len < 1:
            raise ValueError(f"key_len and value_len must be >= 1, got {key_len}, {value_len}")
        if not 0.0 <= record_fraction <= 1.0:
            raise ValueError(f"record_fraction must be in [0, 1], got {record_fraction}")

        self.vocab_size = int(vocab_size)
        self.seed = _check_uint64("seed", seed)
        self.mean_doc_len = int(mean_doc_len)
        self.min_doc_len = int(min_doc_len)
        self.zipf_exponent = float(zipf_exponent)
        self.key_len = int(key_len)
        self.value_len = int(value_len)
        self.record_fraction = float(record_fraction)

        self.eot_id, self.mark_id = _choose_special_ids(self.vocab_size, eot_id)
        self.content_ids = np.setdiff1d(np.arange(self.vocab_size, dtype=np.int64), [self.eot_id, self.mark_id])
        language_rng = np.random.Generator(np.random.Philox(key=_LANGUAGE_KEY))
        # rank_to_id[r] is the content id of the r-th most frequent lexicon token.
        self.rank_to_id = language_rng.permutation(self.content_ids)
        self.lexicon, self.word_lengths = _make_lexicon(language_rng, self.rank_to_id, self.zipf_exponent)
        self._filler_cdf = _zipf_cdf(len(self.word_lengths), self.zipf_exponent)
        # Keys are unique within a window; cap their use at half the key space so
        # rejection sampling of a fresh key needs about two draws at worst.
        # (Capped so it stays an int64 for numpy arithmetic with long keys.)
        self._max_keys_per_window = min(len(self.content_ids) ** self.key_len // 2, 2**62)

    # ------------------------------------------------------------------ public API

    @property
    def record_len(self) -> int:
        """Tokens in one recall record: MARK + key + value."""
        return 1 + self.key_len + self.value_len

    @property
    def special_ids(self) -> dict[str, int]:
        return {"eot": self.eot_id, "mark": self.mark_id}

    def window(self, index: int, length: int) -> np.ndarray:
        """The ``index``-th window: int64 array of shape ``(length,)``, starting with EOT."""
        return self._generate(index, length)[0]

    def recall_mask(self, index: int, length: int) -> np.ndarray:
        """Bool array ``(length,)``: True exactly at the value tokens of repeated records.

        Aligned with ``window(index, length)`` token positions; for next-token labels
        ``window[1:]`` use ``recall_mask[1:]`` (see module docstring).
        """
        return self._generate(index, length)[1]

    def window_with_recall_mask(self, index: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``(window(index, length), recall_mask(index, length))`` from one generation."""
        return self._generate(index, length)

    def batch(self, indices: Iterable[int], length: int) -> tuple[np.ndarray, np.ndarray]:
        """Stack windows: ``(tokens int64 [B, length], recall_mask bool [B, length])``."""
        pairs = [self._generate(i, length) for i in indices]
        if not pairs:
            return np.empty((0, length), np.int64), np.empty((0, length), bool)
        tokens, masks = zip(*pairs)
        return np.stack(tokens), np.stack(masks)

    def recall_probe(self, index: int, gap: int, with_needle: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """An induction-needle probe in this source's own language: (tokens, value_positions).

        ``EOT, MARK key value, <gap filler tokens>, MARK key value`` as one document; the value
        tokens of the repeat (at ``value_positions``) are predictable only by recalling the first
        record across the gap. ``with_needle=False`` gives the control: the first record is replaced
        by filler, so the sequence has the same length but nothing to recall.
        """
        rng = self._window_rng(index)
        record = self._sample_records(rng, 1)[0]
        filler = self._sample_filler(rng, gap)  # drawn before the control's stand-in: same haystack in both
        first = record if with_needle else self._sample_filler(rng, self.record_len)
        tokens = np.concatenate([[self.eot_id], first, filler, record]).astype(np.int64)
        return tokens, np.arange(len(tokens) - self.value_len, len(tokens))

    def __repr__(self) -> str:
        return (
            f"SyntheticSource(vocab_size={self.vocab_size}, eot_id={self.eot_id}, "
            f"seed={self.seed}, mean_doc_len={self.mean_doc_len}, "
            f"min_doc_len={self.min_doc_len}, zipf_exponent={self.zipf_exponent}, "
            f"key_len={self.key_len}, value_len={self.value_len}, "
            f"record_fraction={self.record_fraction}; mark_id={self.mark_id})"
        )

    # ------------------------------------------------------------------ generation

    def _window_rng(self, index: int) -> np.random.Generator:
        # Counter-based generator keyed by (seed, index): no shared state between calls.
        key = np.array([self.seed, _check_uint64("index", index)], dtype=np.uint64)
        return np.random.Generator(np.random.Philox(key=key))

    def _generate(self, index: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        length = int(length)
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        rng = self._window_rng(index)
        # Fill everything with filler first (one vectorised draw), then overwrite the
        # document separators and the recall records.
        tokens = self._sample_filler(rng, length)
        mask = np.zeros(length, dtype=bool)
        doc_starts, doc_ends = self._sample_documents(rng, length)
        tokens[doc_starts] = self.eot_id
        first_starts, repeat_starts = self._sample_record_slots(rng, doc_starts + 1, doc_ends)
        records = self._sample_records(rng, len(first_starts))
        self._write_records(tokens, first_starts, records)
        self._write_records(tokens, repeat_starts, records)
        value_positions = repeat_starts[:, None] + np.arange(1 + self.key_len, self.record_len)
        mask[value_positions[value_positions < length]] = True
        return tokens, mask

    def _sample_filler(self, rng: np.random.Generator, size: int) -> np.ndarray:
        # Every word has at least one token, so `size` words always cover `size` tokens.
        words = np.searchsorted(self._filler_cdf, rng.random(size), side="right")
        # Guard against a uniform draw landing past a cdf[-1] rounded below 1.0.
        np.minimum(words, len(self.word_lengths) - 1, out=words)
        used = np.arange(self.lexicon.shape[1]) < self.word_lengths[words][:, None]
        return self.lexicon[words][used][:size]

    def _sample_documents(self, rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Planned (starts, ends) of the documents that start inside the window.

        The last document may end past ``length``; it is generated as planned and cut,
        so documents do not get shorter near the window edge.
        """
        success_p = 1.0 / (self.mean_doc_len - self.min_doc_len + 1)
        chunk = length // self.mean_doc_len + 2
        doc_lengths: list[np.ndarray] = []
        total = 0
        while total < length:
            drawn = self.min_doc_len - 1 + rng.geometric(success_p, size=chunk)
            doc_lengths.append(drawn)
            total += int(drawn.sum())
        lengths = np.concatenate(doc_lengths) if doc_lengths else np.empty(0, np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        inside = starts < length
        return starts[inside], ends[inside]

    def _sample_pairs_per_document(self, rng: np.random.Generator, body_lens: np.ndarray) -> np.ndarray:
        """Record pairs per document: about ``record_fraction`` of each body, if they fit."""
        pair_len = 2 * self.record_len
        expected = self.record_fraction * body_lens / pair_len
        whole = np.floor(expected)
        pairs = (whole + (rng.random(len(body_lens)) < expected - whole)).astype(np.int64)
        np.minimum(pairs, body_lens // pair_len, out=pairs)
        # Keep within the per-window key budget, earlier documents first.
        budget_left = np.maximum(self._max_keys_per_window - (np.cumsum(pairs) - pairs), 0)
        return np.minimum(pairs, budget_left)

    def _sample_record_slots(
        self, rng: np.random.Generator, body_starts: np.ndarray, body_ends: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Start positions of (first occurrence, repeat) for every record pair in the window.

        Each document body gets ``2 * pairs`` non-overlapping record slots placed
        uniformly at random; slots are then paired at random within the document and
        the earlier slot of each pair holds the first occurrence. Random pairing gives
        interleaved records and gaps of every size.
        """
        record_len = self.record_len
        body_lens = body_ends - body_starts
        slots_per_doc = 2 * self._sample_pairs_per_document(rng, body_lens)
        total_slots = int(slots_per_doc.sum())
        doc_of_slot = np.repeat(np.arange(len(body_lens)), slots_per_doc)

        # Uniform non-overlapping slots: sorted offsets into each body's free space,
        # each shifted past the records before it in the same document.
        free_space = (body_lens - slots_per_doc * record_len)[doc_of_slot]
        offsets = np.floor(rng.random(total_slots) * (free_space + 1)).astype(np.int64)
        offsets = offsets[np.lexsort((offsets, doc_of_slot))]  # sort within each document
        first_slot_of_doc = np.cumsum(slots_per_doc) - slots_per_doc
        rank_in_doc = np.arange(total_slots) - first_slot_of_doc[doc_of_slot]
        slot_starts = body_starts[doc_of_slot] + offsets + rank_in_doc * record_len

        # Shuffle within documents (groups stay contiguous and even-sized), then pair
        # neighbours: every pair lies inside one document.
        shuffled = slot_starts[np.lexsort((rng.random(total_slots), doc_of_slot))]
        pairs = np.sort(shuffled.reshape(-1, 2), axis=1)
        return pairs[:, 0], pairs[:, 1]

    def _sample_records(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` records ``MARK key value`` with uniform random key and value tokens."""
        num_content = len(self.content_ids)
        key_indices = rng.integers(0, num_content, size=(count, self.key_len))
        self._make_keys_unique(rng, key_indices)
        value_indices = rng.integers(0, num_content, size=(count, self.value_len))
        records = np.empty((count, self.record_len), dtype=np.int64)
        records[:, 0] = self.mark_id
        records[:, 1 : 1 + self.key_len] = self.content_ids[key_indices]
        records[:, 1 + self.key_len :] = self.content_ids[value_indices]
        return records

    def _make_keys_unique(self, rng: np.random.Generator, key_indices: np.ndarray) -> None:
        """Redraw repeated keys in place so each key maps to one value within a window.

        Without this, two records with the same key and different values would make
        recall ambiguous. The key budget keeps the expected number of redraws small.
        """
        seen: set[bytes] = set()
        for row in key_indices:
            while row.tobytes() in seen:
                row[:] = rng.integers(0, len(self.content_ids), size=self.key_len)
            seen.add(row.tobytes())

    @staticmethod
    def _write_records(tokens: np.ndarray, starts: np.ndarray, records: np.ndarray) -> None:
        """Write ``records[j]`` at ``starts[j]``, cutting whatever runs past the window."""
        positions = starts[:, None] + np.arange(records.shape[1])
        inside = positions < len(tokens)
        tokens[positions[inside]] = records[inside]
