"""Tests for the built-in synthetic data source and the tokenizers."""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest
import torch

from atma_titan.data.synthetic import SyntheticSource
from atma_titan.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer

WINDOW = 257  # a 256-token training sequence plus its shifted label


# ---------------------------------------------------------------- helpers


def scan_records(tokens: np.ndarray, source: SyntheticSource):
    """Independently re-derive recall targets from the tokens alone.

    Walks the window, tracking documents (EOT) and records (MARK key value). Returns
    (expected_mask, record_spans, violations) where expected_mask is True at the value
    tokens of a record whose key already occurred earlier in the same document, and
    violations lists repeats whose value differs from the earlier one.
    """
    length = len(tokens)
    k, r = source.key_len, source.record_len
    expected = np.zeros(length, dtype=bool)
    in_record = np.zeros(length, dtype=bool)
    violations = []
    doc_values: dict[tuple, tuple] = {}
    for p in range(length):
        if tokens[p] == source.eot_id:
            doc_values = {}  # recall is scoped to the document
        if tokens[p] != source.mark_id:
            continue
        in_record[p : p + r] = True
        key = tuple(tokens[p + 1 : p + 1 + k].tolist())
        value = tuple(tokens[p + 1 + k : p + r].tolist())
        if len(key) < k:
            continue  # key cut by the window edge: cannot be recalled
        if key in doc_values:
            expected[p + 1 + k : p + r] = True
            earlier = doc_values[key]
            if value != earlier[: len(value)]:
                violations.append((p, key, earlier, value))
        else:
            doc_values[key] = value
    return expected, in_record, violations


def filler_tokens(tokens: np.ndarray, source: SyntheticSource) -> np.ndarray:
    _, in_record, _ = scan_records(tokens, source)
    return tokens[~in_record & (tokens != source.eot_id)]


def entropy_nats(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------- determinism


def test_same_seed_and_index_give_identical_windows():
    a = SyntheticSource(512, eot_id=256, seed=3)
    b = SyntheticSource(512, eot_id=256, seed=3)
    for index in (0, 1, 17, 10**12):
        np.testing.assert_array_equal(a.window(index, WINDOW), b.window(index, WINDOW))
        np.testing.assert_array_equal(a.recall_mask(index, WINDOW), b.recall_mask(index, WINDOW))


def test_window_does_not_depend_on_other_calls():
    source = SyntheticSource(512, seed=1)
    alone = SyntheticSource(512, seed=1).window(5, WINDOW)
    for index in (9, 0, 4, 6):
        source.window(index, WINDOW)
    np.testing.assert_array_equal(source.window(5, WINDOW), alone)


def test_different_index_or_seed_gives_different_windows():
    source = SyntheticSource(512, seed=0)
    other_seed = SyntheticSource(512, seed=1)
    assert not np.array_equal(source.window(0, WINDOW), source.window(1, WINDOW))
    assert not np.array_equal(source.window(0, WINDOW), other_seed.window(0, WINDOW))


def test_language_is_shared_across_seeds():
    # A different seed must be a held-out split of the same task, not a new language.
    np.testing.assert_array_equal(SyntheticSource(512, seed=0).rank_to_id, SyntheticSource(512, seed=99).rank_to_id)


def test_batch_and_combined_call_match_single_calls():
    source = SyntheticSource(256, seed=2)
    tokens, masks = source.batch([3, 8, 1], WINDOW)
    assert tokens.shape == masks.shape == (3, WINDOW)
    for row, index in enumerate([3, 8, 1]):
        window, mask = source.window_with_recall_mask(index, WINDOW)
        np.testing.assert_array_equal(tokens[row], window)
        np.testing.assert_array_equal(masks[row], mask)
        np.testing.assert_array_equal(source.recall_mask(index, WINDOW), mask)


# ---------------------------------------------------------------- ids and layout


@pytest.mark.parametrize(
    "vocab_size, eot_id, expected_specials",
    [
        (64, None, {"eot": 63, "mark": 62}),
        (257, 256, {"eot": 256, "mark": 255}),
        (512, 256, {"eot": 256, "mark": 511}),
        (50304, None, {"eot": 50303, "mark": 50302}),
        (50304, 50256, {"eot": 50256, "mark": 50303}),
    ],
)
def test_ids_in_range_and_specials_reserved(vocab_size, eot_id, expected_specials):
    source = SyntheticSource(vocab_size, eot_id=eot_id, seed=7)
    assert source.special_ids == expected_specials
    assert source.eot_id not in source.content_ids and source.mark_id not in source.content_ids
    assert len(source.content_ids) == vocab_size - 2
    tokens, _ = source.batch(range(32), WINDOW)
    assert tokens.dtype == np.int64 and tokens.shape == (32, WINDOW)
    assert tokens.min() >= 0 and tokens.max() < vocab_size


def test_eot_only_at_document_starts():
    source = SyntheticSource(512, eot_id=256, seed=0, mean_doc_len=64, min_doc_len=8)
    tokens, _ = source.batch(range(200), WINDOW)
    assert (tokens[:, 0] == source.eot_id).all()
    boundaries_per_window = (tokens == source.eot_id).sum(axis=1)
    # Several documents per window, about WINDOW / mean_doc_len on average.
    assert 3.0 < boundaries_per_window.mean() < 6.0
    for window in tokens:
        starts = np.flatnonzero(window == source.eot_id)
        # A stray EOT inside a document would show up as a too-short document.
        assert (np.diff(starts) >= source.min_doc_len).all()


def test_records_stay_inside_their_document():
    source = SyntheticSource(256, seed=4)
    for window in source.batch(range(50), WINDOW)[0]:
        for p in np.flatnonzero(window == source.mark_id):
            body = window[p + 1 : p + source.record_len]
            assert not np.isin(body, [source.eot_id, source.mark_id]).any()


def test_empty_and_tiny_windows():
    source = SyntheticSource(64)
    assert source.window(0, 0).shape == (0,)
    np.testing.assert_array_equal(source.window(0, 1), [source.eot_id])


def test_invalid_arguments_raise():
    with pytest.raises(ValueError):
        SyntheticSource(3)
    with pytest.raises(ValueError, match="eot_id"):
        SyntheticSource(64, eot_id=64)
    with pytest.raises(ValueError, match="mean_doc_len"):
        SyntheticSource(64, mean_doc_len=4, min_doc_len=8)
    with pytest.raises(ValueError, match="index"):
        SyntheticSource(64).window(-1, 8)


# ---------------------------------------------------------------- recall


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(vocab_size=64),
        dict(vocab_size=512, eot_id=256, key_len=3, value_len=4),
        dict(vocab_size=50304, record_fraction=0.6),
        # Tiny key space (62 keys) over long windows exercises the key budget.
        dict(vocab_size=64, key_len=1, value_len=1, mean_doc_len=256),
    ],
)
def test_recall_mask_marks_exactly_the_recallable_values(kwargs):
    source = SyntheticSource(seed=11, **kwargs)
    length = 1024 if kwargs.get("mean_doc_len") else WINDOW
    total_targets = 0
    for index in range(40):
        tokens, mask = source.window_with_recall_mask(index, length)
        expected, _, violations = scan_records(tokens, source)
        assert violations == []
        np.testing.assert_array_equal(mask, expected)
        total_targets += int(mask.sum())
    assert total_targets > 100  # recall is actually exercised


def test_keys_are_unique_within_a_window():
    source = SyntheticSource(64, seed=5, key_len=1, value_len=1, mean_doc_len=256)
    for window in source.batch(range(20), 2048)[0]:
        marks = np.flatnonzero(window[:-1] == source.mark_id)
        key_counts = Counter(window[marks + 1].tolist())
        assert max(key_counts.values()) <= 2


def test_recall_targets_are_not_guessable_from_unigram_statistics():
    source = SyntheticSource(512, eot_id=256, seed=0)
    tokens, masks = source.batch(range(300), WINDOW)
    most_common_filler = source.rank_to_id[0]
    targets = tokens[masks]
    assert len(targets) > 1000
    # Filler's top token is ~10% of filler; values are uniform over 510 ids.
    assert (targets == most_common_filler).mean() < 0.02
    assert len(np.unique(targets)) > 300


# ---------------------------------------------------------------- learnability


def test_filler_is_zipfian():
    source = SyntheticSource(64, seed=0)
    filler = np.concatenate([filler_tokens(w, source) for w in source.batch(range(200), WINDOW)[0]])
    counts = np.bincount(filler, minlength=source.vocab_size)[source.content_ids]
    assert counts.max() > 10 * np.median(counts)
    assert source.rank_to_id[0] == source.content_ids[np.argmax(counts)]


@pytest.mark.parametrize("vocab_size", [64, 512])
def test_filler_entropy_is_well_below_uniform(vocab_size):
    # Pure noise would sit at log(num_content); a model can learn the gap.
    source = SyntheticSource(vocab_size, seed=0)
    filler = np.concatenate([filler_tokens(w, source) for w in source.batch(range(200), WINDOW)[0]])
    counts = np.bincount(filler, minlength=vocab_size)[source.content_ids]
    assert entropy_nats(counts) < 0.8 * math.log(len(source.content_ids))


def test_generation_is_fast():
    source = SyntheticSource(50304, seed=0)
    source.batch(range(4), WINDOW)  # warm up
    start = time.perf_counter()
    source.batch(range(64), WINDOW)
    per_window = (time.perf_counter() - start) / 64
    assert per_window < 5e-3, f"{per_window * 1e3:.2f} ms per window"


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_unicode():
    tokenizer = ByteTokenizer()
    text = "héllo wörld — 日本語 🚀\n\ttabs & <tags>"
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(np.array(ids)) == text
    assert tokenizer.decode(torch.tensor(ids)) == text


def test_byte_tokenizer_decode_is_graceful():
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.eot_id, tokenizer.name) == (257, 256, "byte")
    eot = tokenizer.eot_id
    assert tokenizer.decode([eot, *tokenizer.encode("ab"), eot, *tokenizer.encode("c")]) == "abc"
    assert tokenizer.decode([0xFF, ord("a")]) == "\ufffda"  # invalid UTF-8
    assert tokenizer.decode([ord("a"), 300]) == "a\ufffd"  # id from a padded vocab
    assert tokenizer.decode([]) == ""


def test_byte_tokenizer_decodes_synthetic_windows():
    tokenizer = build_tokenizer("byte")
    source = SyntheticSource(tokenizer.vocab_size, eot_id=tokenizer.eot_id)
    assert source.special_ids == {"eot": 256, "mark": 255}
    assert isinstance(tokenizer.decode(source.window(0, WINDOW)), str)


def test_build_tokenizer():
    tokenizer = build_tokenizer("byte")
    assert isinstance(tokenizer, Tokenizer) and isinstance(tokenizer, ByteTokenizer)
    with pytest.raises(ValueError, match=r"'gpt9'.*'byte'"):
        build_tokenizer("gpt9")


def test_recall_probe_layout_and_control():
    source = SyntheticSource(512, eot_id=256, seed=4)
    tokens, positions = source.recall_probe(7, gap=40)
    record_len = source.record_len
    assert tokens[0] == 256 and len(tokens) == 1 + record_len + 40 + record_len
    assert np.array_equal(tokens[1 : 1 + record_len], tokens[-record_len:])  # the repeat equals the needle
    assert tokens[1] == source.mark_id and (tokens == source.mark_id).sum() == 2
    assert list(positions) == list(range(len(tokens) - source.value_len, len(tokens)))
    control, _ = source.recall_probe(7, gap=40, with_needle=False)
    assert len(control) == len(tokens) and np.array_equal(control[1 + record_len :], tokens[1 + record_len :])
    assert (control == source.mark_id).sum() == 1  # only the query: nothing to recall


@pytest.mark.parametrize("kwargs", [{}, {"record_fraction": 1.0, "value_len": 4}])
def test_recall_mask_is_solvable_by_an_oracle_copier(kwargs):
    """Every masked label is the token that followed the same MARK+key earlier in the window.

    An oracle that finds the previous `MARK k_1..k_K` occurrence and copies what followed it
    predicts every recall-masked token, and the masked tokens are never the first occurrence.
    """
    source = SyntheticSource(512, eot_id=256, seed=3, **kwargs)
    K, checked = source.key_len, 0
    for index in range(200):
        tokens, mask = source.window_with_recall_mask(index, 129)
        for p in np.flatnonzero(mask):
            start = p - 1
            while tokens[start] != source.mark_id:  # the repeat's own MARK
                start -= 1
            assert 1 + K <= p - start < source.record_len
            prefix = tokens[start:p]
            earlier = [j for j in range(start) if np.array_equal(tokens[j : j + len(prefix)], prefix)]
            assert earlier, (index, p)
            assert {tokens[j + len(prefix)] for j in earlier} == {tokens[p]}
            checked += 1
    assert checked > 100
