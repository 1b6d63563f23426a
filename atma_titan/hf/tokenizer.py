"""The run's tokenizer as Hugging Face tokenizer files, so `AutoTokenizer` and lm-eval's `hf` model load an export.

Each of atma_titan's tokenizers becomes a `tokenizers` fast tokenizer that gives the same ids:

- "byte": ids 0-255 are the UTF-8 bytes (byte-level characters, no merges), 256 is `<|endoftext|>`;
  decoding replaces invalid UTF-8 with U+FFFD as `ByteTokenizer.decode` does (ids past 256, which a
  padded embedding table can sample, are skipped, as `tokenizers` skips any id it does not know).
- "gpt2": tiktoken's encoding rebuilt as a byte-level BPE. Its ranks are the ids; each token's merge is the
  pair that tiktoken's own merging (lowest rank first) reaches the token from; its split regex is the
  pre-tokenizer; a piece that is a whole token is that token (`ignore_merges`), as in tiktoken.
- a Hugging Face tokenizer (a tokenizer.json path or `hf:<id>`): its own tokenizer.json.

tokenizer_config.json and special_tokens_map.json make the end-of-text token the EOS (and, for byte and
gpt2, the BOS too: the packer puts it before every document). A tokenizer that cannot be built where the
export runs (gpt2 offline without tiktoken's cached files, an uncached hub tokenizer) leaves the folder
without tokenizer files; `TokenizerExport.missing` says why.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from atma_titan.data.tokenizer import (
    ByteTokenizer,
    GPT2Tokenizer,
    HFTokenizer,
    TokenizerError,
    build_tokenizer,
    known_eot_id,
)
from atma_titan.utils.errors import import_optional

__all__ = ["EOT_TOKEN", "TOKENIZER_FILES", "TokenizerExport", "as_hf_tokenizer", "prepare_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOT_TOKEN = "<|endoftext|>"  # the byte tokenizer's EOT has no text of its own: it gets GPT-2's name


@dataclass(frozen=True)
class TokenizerExport:
    """What an export writes of the run's tokenizer `name` (data.tokenizer).

    `backend` is the `tokenizers.Tokenizer` saved as tokenizer.json, None when there is none to write
    (then `missing` says why); `eot_id` is None only when the tokenizer could not be built and its
    end-of-text id is not known without it."""

    name: str
    eot_id: int | None
    backend: object | None = None
    eot_is_bos: bool = False  # byte and gpt2 (an HF tokenizer may have a BOS of its own)
    missing: str = ""

    @property
    def eot_token(self) -> str | None:
        return None if self.backend is None else self.backend.id_to_token(self.eot_id)

    def write(self, folder: Path) -> None:
        """tokenizer.json, tokenizer_config.json and special_tokens_map.json into `folder` (when there is a backend)."""
        if self.backend is None:
            return
        tokenizer_file, config_file, map_file = (folder / name for name in TOKENIZER_FILES)
        self.backend.save(str(tokenizer_file))
        roles = ("bos_token", "eos_token") if self.eot_is_bos else ("eos_token",)
        special = {role: self.eot_token for role in roles}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "clean_up_tokenization_spaces": False}
        config_file.write_text(json.dumps(config, indent=2) + "\n")
        map_file.write_text(json.dumps(special, indent=2) + "\n")


def prepare_tokenizer(name: str) -> TokenizerExport:
    """Build the run's tokenizer and its Hugging Face form; one that cannot be built here is described, not raised."""
    try:
        tokenizer = build_tokenizer(name)
    except TokenizerError as e:  # offline without the files, a moved tokenizer.json, ...
        return TokenizerExport(name, known_eot_id(name), missing=str(e).split(" (", 1)[0])
    backend = as_hf_tokenizer(tokenizer)
    missing = "" if backend is not None else f"atma_titan has no Hugging Face form of {type(tokenizer).__name__}"
    eot_is_bos = isinstance(tokenizer, (ByteTokenizer, GPT2Tokenizer))
    return TokenizerExport(name, tokenizer.eot_id, backend, eot_is_bos=eot_is_bos, missing=missing)


def as_hf_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` that encodes text to the same ids as `tokenizer`; None for a kind it cannot write."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.backend
    if isinstance(tokenizer, GPT2Tokenizer):
        return tiktoken_as_hf(tokenizer.encoding)
    if isinstance(tokenizer, ByteTokenizer):
        return byte_tokenizer_as_hf(tokenizer.eot_id)
    return None


def _tokenizers():
    return import_optional("tokenizers", "data", "writing the tokenizer into a Hugging Face export")


@functools.cache
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character table (byte-level BPE's alphabet): printable bytes stand for themselves."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _as_chars(token: bytes) -> str:
    chars = _byte_chars()
    return "".join(chars[b] for b in token)


def byte_tokenizer_as_hf(eot_id: int):
    """Bytes as ids 0-255 and `<|endoftext|>` as `eot_id`: a byte-level BPE without merges."""
    tk = _tokenizers()
    vocab = {char: byte for byte, char in _byte_chars().items()} | {EOT_TOKEN: eot_id}
    backend = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # text -> bytes
    backend.decoder = tk.decoders.ByteLevel()  # bytes -> text, invalid UTF-8 -> U+FFFD
    backend.add_special_tokens([tk.AddedToken(EOT_TOKEN, special=True, normalized=False)])
    return backend


def _merge_of(ranks: dict[bytes, int], token: bytes, rank: int) -> list[bytes]:
    """The parts tiktoken's merging leaves of `token` using only tokens ranked below it (two for a learnt merge)."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best, i = min(pairs)  # the lowest rank, the leftmost of equals: tiktoken's order
        if best >= rank:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def tiktoken_as_hf(encoding):
    """A tiktoken `Encoding` (mergeable ranks, split regex, special tokens) as a byte-level BPE with the same ids."""
    tk = _tokenizers()
    ranks = encoding._mergeable_ranks  # tiktoken keeps no public copy of its ranks
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = _merge_of(ranks, token, rank) if len(token) > 1 else []
        if len(parts) == 2:  # a token no merge reaches is still emitted whole (ignore_merges)
            merges.append((_as_chars(parts[0]), _as_chars(parts[1])))
    specials = encoding._special_tokens
    vocab = {_as_chars(token): rank for token, rank in ranks.items()} | specials
    backend = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    backend.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [
            tk.pre_tokenizers.Split(tk.Regex(encoding._pat_str), behavior="isolated"),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = tk.decoders.ByteLevel()
    backend.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([tk.AddedToken(text, special=True, normalized=False) for text in specials])
    return backend
