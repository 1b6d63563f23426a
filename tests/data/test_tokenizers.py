"""Tests for the tokenizer registry: byte, GPT-2 (tiktoken) and Hugging Face tokenizers, all offline."""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile

import pytest
from bpe import TEXTS, train_bpe

from atma_titan.data.tokenizer import (
    EOT_CANDIDATES,
    ByteTokenizer,
    GPT2Tokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    encode_batch,
)

GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)


# ---------------------------------------------------------------- byte


def test_byte_tokenizer_batch_matches_single():
    tokenizer = build_tokenizer("byte")
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.encode_batch(TEXTS) == [tokenizer.encode(t) for t in TEXTS]
    assert all(tokenizer.decode(ids) == t for ids, t in zip(tokenizer.encode_batch(TEXTS), TEXTS))


def test_encode_batch_falls_back_to_a_loop():
    class Minimal:  # only the protocol: no encode_batch
        name, vocab_size, eot_id = "minimal", 3, 2

        def encode(self, text):
            return [len(text) % 2]

        def decode(self, ids):
            return ""

    assert isinstance(Minimal(), Tokenizer)
    assert encode_batch(Minimal(), ["a", "ab", "abc"]) == [[1], [0], [1]]


# ---------------------------------------------------------------- GPT-2 through tiktoken


def tiktoken_cache_dir() -> str:
    """Where tiktoken looks for its cached BPE files (the same rule as tiktoken.load.read_file_cached)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def gpt2_files_cached() -> bool:
    cache = tiktoken_cache_dir()
    return all(os.path.exists(os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())) for url in GPT2_URLS)


@pytest.mark.skipif(not gpt2_files_cached(), reason="tiktoken's GPT-2 BPE files are not cached (offline)")
def test_gpt2_round_trip():
    tokenizer = build_tokenizer("gpt2")
    assert (tokenizer.name, tokenizer.vocab_size, tokenizer.eot_id) == ("gpt2", 50257, 50256)
    assert tokenizer.encode("hello world") == [31373, 995]
    ids = tokenizer.encode("a <|endoftext|> b")
    assert tokenizer.eot_id not in ids and tokenizer.decode(ids) == "a <|endoftext|> b"  # text is text
    assert tokenizer.encode_batch(TEXTS) == [tokenizer.encode(t) for t in TEXTS]
    assert tokenizer.decode([*tokenizer.encode("ab"), 50256, 60000]) == "ab\ufffd"


def test_gpt2_offline_error_says_how_to_fix_it(tmp_path, monkeypatch):
    pytest.importorskip("tiktoken")
    import tiktoken.load
    import tiktoken.registry

    def no_network(url):
        raise ConnectionError(f"Failed to resolve {url}")

    # An empty cache and no network, whatever this machine has: the offline path, deterministically.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "gpt2", raising=False)
    with pytest.raises(TokenizerError) as err:
        build_tokenizer("gpt2")
    message = str(err.value)
    assert "GPT-2 BPE files could not be downloaded" in message and "TIKTOKEN_CACHE_DIR" in message
    assert GPT2_URLS[0] in message and GPT2_URLS[1] in message
    assert "tokenizer.json" in message and isinstance(err.value, ValueError)


def test_gpt2_wrapper_treats_special_text_as_text():
    tiktoken = pytest.importorskip("tiktoken")
    # A byte-level stand-in for the GPT-2 encoding (no download): same special token and id.
    encoding = tiktoken.Encoding(
        name="bytes-with-gpt2-eot",
        pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|endoftext|>": 50256},
    )
    tokenizer = GPT2Tokenizer(encoding)
    ids = tokenizer.encode("x<|endoftext|>y")
    assert 50256 not in ids and ids == list(b"x<|endoftext|>y")
    assert tokenizer.encode_batch(["x<|endoftext|>y", "z"]) == [ids, [ord("z")]]
    assert tokenizer.decode([120, 50256, 121, 60000]) == "xy\ufffd"  # EOT dropped, unknown id -> U+FFFD


# ---------------------------------------------------------------- Hugging Face tokenizers


@pytest.fixture
def bpe_file(tmp_path):
    pytest.importorskip("tokenizers")
    return train_bpe(tmp_path / "tokenizer.json", ["<pad>", "<|endoftext|>"])


def test_hf_tokenizer_from_file_round_trips(bpe_file):
    tokenizer = build_tokenizer(str(bpe_file))
    assert isinstance(tokenizer, HFTokenizer) and isinstance(tokenizer, Tokenizer)
    assert tokenizer.eot_id == 1 and tokenizer.eot_token == "<|endoftext|>"
    assert tokenizer.vocab_size == 300
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode_batch(TEXTS) == [tokenizer.encode(t) for t in TEXTS]
    assert len(tokenizer.encode("the quick brown fox")) < len("the quick brown fox")  # merges were learned
    assert tokenizer.decode([tokenizer.eot_id, *tokenizer.encode("ab")]) == "ab"


def test_hf_tokenizer_from_directory_and_text_is_text(bpe_file):
    tokenizer = build_tokenizer(str(bpe_file.parent))  # a directory holding tokenizer.json
    ids = tokenizer.encode("a <|endoftext|> b")
    assert tokenizer.eot_id not in ids  # special-token text in a document is not a boundary
    assert tokenizer.decode(ids) == "a <|endoftext|> b"


def test_hf_tokenizer_pickles_with_text_as_text(bpe_file):
    tokenizer = build_tokenizer(str(bpe_file))
    copy = pickle.loads(pickle.dumps(tokenizer))  # as sent to data-loader workers
    assert copy.encode("a <|endoftext|> b") == tokenizer.encode("a <|endoftext|> b")
    assert (copy.eot_id, copy.vocab_size, copy.name) == (tokenizer.eot_id, tokenizer.vocab_size, tokenizer.name)


def test_hf_eot_candidates_in_order_and_explicit(tmp_path):
    pytest.importorskip("tokenizers")
    path = train_bpe(tmp_path / "llama.json", ["<unk>", "<eos>", "</s>"])
    assert EOT_CANDIDATES.index("</s>") < EOT_CANDIDATES.index("<eos>")
    assert build_tokenizer(str(path)).eot_id == 2  # "</s>" is tried before "<eos>"
    assert build_tokenizer(str(path), eot_token="<eos>").eot_id == 1
    assert build_tokenizer(str(path)).vocab_size == 300


def test_hf_missing_eot_names_file_and_candidates(tmp_path):
    pytest.importorskip("tokenizers")
    path = train_bpe(tmp_path / "noeot.json", ["<pad>"])
    with pytest.raises(TokenizerError) as err:
        build_tokenizer(str(path))
    message = str(err.value)
    assert str(path) in message and all(repr(t) in message for t in EOT_CANDIDATES)
    with pytest.raises(TokenizerError, match=r"tried '<bos>'"):
        build_tokenizer(str(path), eot_token="<bos>")


def test_missing_or_invalid_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer file not found: .*absent\.json"):
        build_tokenizer(str(tmp_path / "absent.json"))
    with pytest.raises(TokenizerError, match=r"tokenizer file not found: .*tokenizer\.json"):
        build_tokenizer(str(tmp_path))  # a directory without tokenizer.json
    (tmp_path / "broken.json").write_text("{not json")
    pytest.importorskip("tokenizers")
    with pytest.raises(TokenizerError, match=r"broken\.json is not a valid Hugging Face tokenizer\.json"):
        build_tokenizer(str(tmp_path / "broken.json"))


def test_hub_tokenizer_offline_says_what_to_download(monkeypatch):
    pytest.importorskip("tokenizers")
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 does, without waiting on DNS
    with pytest.raises(TokenizerError) as err:
        build_tokenizer("hf:some-org/some-tokenizer-that-is-not-cached")
    message = str(err.value)
    assert "hf download some-org/some-tokenizer-that-is-not-cached tokenizer.json" in message
    assert "data.tokenizer = 'DIR/tokenizer.json'" in message


def test_unknown_name_lists_what_is_allowed():
    with pytest.raises(ValueError) as err:
        build_tokenizer("gpt9")
    message = str(err.value)
    assert "'gpt9'" in message and "'byte'" in message and "'gpt2'" in message
    assert "tokenizer.json" in message and "hf:<org/name>" in message
