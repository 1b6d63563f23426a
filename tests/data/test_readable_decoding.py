"""decode_readable: what `decode` turns into U+FFFD (or prints raw) is shown as <id>, and streamed text only grows.

The byte tokenizer's cases are exact; a tiktoken stand-in with multi-byte ids checks ids that end in
the middle of a character; a tokenizer without `token_bytes` keeps its own decode.
"""

from __future__ import annotations

import random

import pytest

from atma_titan.data.tokenizer import ByteTokenizer, GPT2Tokenizer, decode_readable

BYTES = ByteTokenizer()


@pytest.mark.parametrize(
    "ids, text",
    [
        (list(b"Hi"), "Hi"),
        ([72, 105, 311, 402, 256], "Hi<311><402>"),  # the synthetic language's ids; EOT dropped
        ([*"é".encode(), 0xFF, ord("a")], "é<255>a"),  # a byte that never starts a character
        ([0xE2, 0x82, ord("b")], "<226><130>b"),  # a character cut short
        ([0xE2, 0x82, 0xAC], "€"),
        ([ord("0"), 27, *b"[2J", 29, 127], "0<27>[2J<29><127>"),  # control characters: shown, not sent
        (list(b"a\tb\r\nc"), "a\tb\r\nc"),  # tab and line ends are text
        ([-1, 600], "<-1><600>"),
    ],
)
def test_byte_tokenizer_shows_what_has_no_text_as_ids(ids, text):
    assert decode_readable(BYTES, ids) == text
    assert "\ufffd" not in decode_readable(BYTES, ids)


def test_an_unfinished_character_waits_unless_final():
    ids = [*"é".encode(), 0xE2, 0x82]  # é, then the first two bytes of €
    assert decode_readable(BYTES, ids, final=False) == "é"
    assert decode_readable(BYTES, ids) == "é<226><130>"
    assert decode_readable(BYTES, [*ids, 0xAC], final=False) == "é€"
    assert decode_readable(BYTES, [0xE2, 300, 0x82], final=False) == "<226><300><130>"  # broken by an id: shown


def test_streamed_text_only_grows():
    """Each prefix's text (not final) begins the next one's, and the whole text (final): nothing printed is taken
    back when the rest of a character comes or does not."""
    rng = random.Random(0)
    alphabet = [*range(512), *range(0x80, 0x100), *b"ab \n", 0xC3, 0xE2, 0x82, 0xA9, 256]
    for _ in range(500):
        ids = [rng.choice(alphabet) for _ in range(rng.randrange(20))]
        shown = ""
        for end in range(len(ids) + 1):
            text = decode_readable(BYTES, ids[:end], final=False)
            assert text.startswith(shown), (ids, end)
            shown = text
        assert decode_readable(BYTES, ids).startswith(shown)


def test_multi_byte_ids_that_split_a_character():
    """GPT-2 ids hold several bytes: one may end in the middle of a character that the next one finishes."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {bytes([i]): i for i in range(256)} | {b"x\xe2": 300, b"\x82\xac": 301, b"ab": 302}
    encoding = tiktoken.Encoding(name="split-euro", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    tokenizer = GPT2Tokenizer(encoding)
    assert decode_readable(tokenizer, [300, 301, 302]) == "x€ab"
    assert decode_readable(tokenizer, [300], final=False) == ""  # "x" waits with the half character it holds
    assert decode_readable(tokenizer, [300, 302]) == "<300>ab"
    assert decode_readable(tokenizer, [302, 50256, 50300]) == "ab<50300>"  # EOT dropped, outside the vocabulary


class WordTokenizer:
    """A tokenizer without token_bytes: its own decode, and <id> for ids outside its vocabulary."""

    name, vocab_size, eot_id = "words", 3, 2
    words = ["hello", "world"]

    def encode(self, text):
        return [self.words.index(w) for w in text.split()]

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids if i != self.eot_id)


def test_other_tokenizers_keep_their_decode():
    assert decode_readable(WordTokenizer(), [0, 1, 7, 1, 2]) == "hello world<7>world"
