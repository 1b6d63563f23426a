"""Tokenizers: a minimal protocol, a dependency-free byte tokenizer, GPT-2 and Hugging Face ones.

Everything in atma_titan that needs a tokenizer depends only on the ``Tokenizer``
protocol (``name``, ``vocab_size``, ``eot_id``, ``encode``, ``decode``); ``encode_batch``
(a method on the built-in tokenizers, and a module function that falls back to a loop
for any other tokenizer) encodes many documents at once where the backend is faster so.
``decode_readable`` shows what ``decode`` hides: an id outside the tokenizer's vocabulary
(the debug model's synthetic language uses ids 257-511 of a 512-id table), bytes that are
not UTF-8 and control characters come out as ``<311>``, not as U+FFFD or raw; the
byte-level tokenizers give it the bytes of each id (``token_bytes``).

``build_tokenizer(name)`` is the single entry point used by configs:

* ``"byte"``: UTF-8 bytes, vocab 257, EOT 256 (no files, no download);
* ``"gpt2"``: GPT-2 BPE through tiktoken, vocab 50257, EOT 50256. tiktoken downloads its
  two BPE files on first use and caches them; offline, point ``TIKTOKEN_CACHE_DIR`` at a
  copy of that cache (see ``TokenizerError``'s message);
* a path to a Hugging Face ``tokenizer.json`` (any name ending in ``.json``, or a
  directory holding ``tokenizer.json``);
* ``"hf:<org/name>"``: the ``tokenizer.json`` of a Hugging Face hub repository.

Text is always encoded as text: a document containing the characters ``<|endoftext|>``
(or any other special token) is tokenised like any other string and never yields the
EOT id, so EOT marks document boundaries only. No BOS/EOS is added by ``encode``; the
packer puts one EOT before each document. A new named tokenizer is a zero-argument
factory registered in ``_FACTORIES``.
"""

from __future__ import annotations

import bisect
import itertools
import os
from typing import Callable, Iterable, Protocol, runtime_checkable

from atma_titan.utils.errors import InputError, import_optional

__all__ = [
    "Tokenizer",
    "TokenizerError",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "HFTokenizer",
    "EOT_CANDIDATES",
    "build_tokenizer",
    "available_tokenizers",
    "encode_batch",
    "decode_readable",
    "known_eot_id",
    "load_hf_tokenizer_file",
    "load_hf_hub_tokenizer",
]

_REPLACEMENT_UTF8 = "\ufffd".encode("utf-8")


class TokenizerError(InputError):
    """A tokenizer could not be built: unknown name, missing file, or a download that failed."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the framework needs from a tokenizer.

    ``eot_id`` is the end-of-text id placed before each document in token streams.
    ``vocab_size`` counts every id the tokenizer can emit (EOT included); a model's
    embedding table may be larger (padded) but never smaller.
    """

    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _as_int_list(ids) -> list[int]:
    """Accept a list, tuple, numpy array or torch tensor of ids."""
    if hasattr(ids, "tolist"):  # numpy arrays and torch tensors, any shape of 0/1 dims
        ids = ids.tolist()
        if isinstance(ids, int):
            return [ids]
    return [int(i) for i in ids]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus an end-of-text id 256 (vocab_size 257).

    Needs no files or downloads, so it is the default for debug runs. ``decode``
    never raises: EOT ids are dropped, invalid UTF-8 becomes U+FFFD, and ids that
    are not bytes (e.g. sampled from a padded embedding table) become U+FFFD too.
    """

    name: str = "byte"
    vocab_size: int = 257
    eot_id: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        buffer = bytearray()
        for token in _as_int_list(ids):
            if 0 <= token < 256:
                buffer.append(token)
            elif token == self.eot_id:
                continue  # a document separator carries no text
            else:
                buffer += _REPLACEMENT_UTF8
        return buffer.decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes of one id: b"" for EOT (a document separator carries no text), None outside 0..256."""
        if 0 <= token < 256:
            return bytes((token,))
        return b"" if token == self.eot_id else None

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eot_id=256)"


# ---------------------------------------------------------------------------- GPT-2 (tiktoken)

_GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)


def _gpt2_offline_help(error: BaseException) -> str:
    return (
        f"tokenizer 'gpt2': the GPT-2 BPE files could not be downloaded by tiktoken ({type(error).__name__}: {error}). "
        "To work offline, run `python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"` on a machine "
        "with internet, copy its tiktoken cache folder (TIKTOKEN_CACHE_DIR, or by default "
        "<tmp>/data-gym-cache; it holds the two files it fetches, "
        f"{_GPT2_URLS[0]} and {_GPT2_URLS[1]}, each saved under the SHA-1 hex digest of its URL) "
        "here and set TIKTOKEN_CACHE_DIR to that folder; or use a local Hugging Face tokenizer "
        "file instead (data.tokenizer = 'path/to/tokenizer.json')"
    )


def _load_gpt2_encoding():
    tiktoken = import_optional("tiktoken", "data", "tokenizer 'gpt2'")
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as exc:  # requests' ConnectionError, a hash mismatch, an unwritable cache, ...
        raise TokenizerError(_gpt2_offline_help(exc)) from exc


class GPT2Tokenizer:
    """GPT-2 BPE (tiktoken's ``gpt2`` encoding): vocab_size 50257, eot_id 50256 (``<|endoftext|>``).

    ``encode`` treats special-token text as ordinary text (``disallowed_special=()``), so a
    document quoting ``<|endoftext|>`` cannot inject a document boundary. ``decode`` never
    raises: EOT is dropped and ids outside the vocabulary become U+FFFD.
    """

    name: str = "gpt2"
    vocab_size: int = 50257
    eot_id: int = 50256

    def __init__(self, encoding=None):
        self._encoding = encoding if encoding is not None else _load_gpt2_encoding()

    @property
    def encoding(self):
        """The tiktoken ``Encoding`` (the Hugging Face export rebuilds it as a tokenizer.json)."""
        return self._encoding

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode(text, disallowed_special=())

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        # Ordinary = special-token text is text, as in encode(); the batch runs in tiktoken's threads.
        return self._encoding.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        pieces = []
        for token in _as_int_list(ids):
            if 0 <= token < self.eot_id:
                pieces.append(self._encoding.decode_single_token_bytes(token))
            elif token != self.eot_id:
                pieces.append(_REPLACEMENT_UTF8)
        return b"".join(pieces).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes of one id: b"" for EOT, None outside the vocabulary."""
        if 0 <= token < self.eot_id:
            return self._encoding.decode_single_token_bytes(token)
        return b"" if token == self.eot_id else None

    def __repr__(self) -> str:
        return "GPT2Tokenizer(vocab_size=50257, eot_id=50256)"


# ---------------------------------------------------------------------------- Hugging Face tokenizers

# Tried in this order when no eot_token is given: GPT-2/Qwen style, Llama-2/T5 style, Gemma, Llama-3.
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` behind the framework's protocol.

    ``eot_id`` is the id of ``eot_token`` or, when that is None, of the first of
    ``EOT_CANDIDATES`` the vocabulary holds. ``vocab_size`` counts added tokens too.
    ``encode`` adds no special tokens (no BOS/EOS from the post-processor) and encodes
    special-token text as text.
    """

    def __init__(self, tokenizer, name: str, eot_token: str | None = None):
        self._tokenizer = tokenizer
        # Text is text: "</s>" inside a document must not become the EOT id.
        tokenizer.encode_special_tokens = True
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot_token, self.eot_id = _find_eot(tokenizer, name, eot_token)

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` it wraps (the Hugging Face export saves it as tokenizer.json)."""
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        # One call: the Rust side encodes the batch in parallel.
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(_as_int_list(ids), skip_special_tokens=True)

    def __setstate__(self, state: dict) -> None:
        # Pickling (e.g. to data-loader workers) drops encode_special_tokens: set it again.
        self.__dict__.update(state)
        self._tokenizer.encode_special_tokens = True

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id} {self.eot_token!r})"


def _find_eot(tokenizer, name: str, eot_token: str | None) -> tuple[str, int]:
    tried = (eot_token,) if eot_token is not None else EOT_CANDIDATES
    for token in tried:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    raise TokenizerError(
        f"tokenizer {name!r} has no end-of-text token: tried {', '.join(repr(t) for t in tried)}; "
        "pass the right one as eot_token"
    )


def _import_tokenizers():
    return import_optional("tokenizers", "data", "a Hugging Face tokenizer")


def _tokenizer_json_path(name: str) -> str:
    """The tokenizer.json that a path-like name points at (the file, or the one inside a directory)."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer file not found: {path}")
    return path


def load_hf_tokenizer_file(name: str, eot_token: str | None = None) -> HFTokenizer:
    """An ``HFTokenizer`` from a local ``tokenizer.json`` (or a directory holding one)."""
    path = _tokenizer_json_path(name)
    tokenizers = _import_tokenizers()
    try:
        tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises a bare Exception on a malformed file
        raise TokenizerError(f"{path} is not a valid Hugging Face tokenizer.json: {exc}") from exc
    return HFTokenizer(tokenizer, name, eot_token)


def load_hf_hub_tokenizer(repo_id: str, eot_token: str | None = None) -> HFTokenizer:
    """An ``HFTokenizer`` from the ``tokenizer.json`` of hub repository ``repo_id`` (cached by huggingface_hub)."""
    tokenizers = _import_tokenizers()
    try:
        tokenizer = tokenizers.Tokenizer.from_pretrained(repo_id)
    except Exception as exc:  # offline, unknown repository, gated repository, no tokenizer.json
        raise TokenizerError(
            f"could not load tokenizer.json of {repo_id!r} from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}). To work offline, on a machine with internet run "
            f"`hf download {repo_id} tokenizer.json --local-dir DIR` (the hf command comes with huggingface_hub), "
            "copy DIR here and set data.tokenizer = 'DIR/tokenizer.json'"
        ) from exc
    return HFTokenizer(tokenizer, f"hf:{repo_id}", eot_token)


# ---------------------------------------------------------------------------- registry

# name -> zero-argument factory. Adding a named tokenizer is one factory plus one entry here.
_FACTORIES: dict[str, Callable[[], Tokenizer]] = {
    "byte": ByteTokenizer,
    "gpt2": GPT2Tokenizer,
}

_HUB_PREFIX = "hf:"


def available_tokenizers() -> list[str]:
    """Names accepted by ``build_tokenizer`` besides paths and ``hf:`` hub ids, sorted."""
    return sorted(_FACTORIES)


def known_eot_id(name: str) -> int | None:
    """The end-of-text id of a registered tokenizer, known without building it (no files, no download)."""
    return getattr(_FACTORIES.get(name), "eot_id", None)


def _is_path_like(name: str) -> bool:
    return name.endswith(".json") or os.sep in name or "/" in name or name.startswith((".", "~")) or os.path.isdir(name)


def build_tokenizer(name: str, *, eot_token: str | None = None) -> Tokenizer:
    """The tokenizer that ``name`` names: a registered name, a tokenizer.json path, or ``hf:<org/name>``.

    ``eot_token`` picks the end-of-text token of a Hugging Face tokenizer (default: the first
    of ``EOT_CANDIDATES`` it has). Raises ``TokenizerError`` (a ``ValueError``) naming the
    problem: an unknown name (listing what is allowed), a missing file, a failed download.
    """
    factory = _FACTORIES.get(name)
    if factory is not None:
        return factory()
    if name.startswith(_HUB_PREFIX) and len(name) > len(_HUB_PREFIX):
        return load_hf_hub_tokenizer(name[len(_HUB_PREFIX) :], eot_token)
    if _is_path_like(name):
        return load_hf_tokenizer_file(name, eot_token)
    allowed = ", ".join(repr(n) for n in available_tokenizers())
    raise TokenizerError(
        f"unknown tokenizer {name!r}; allowed: {allowed}, a path to a tokenizer.json (or a directory "
        "holding one), or 'hf:<org/name>' for a Hugging Face hub tokenizer"
    )


def encode_batch(tokenizer: Tokenizer, texts: Iterable[str]) -> list[list[int]]:
    """Encode many texts: the tokenizer's own ``encode_batch`` where it has one, else one by one."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is not None:
        return batch(texts)
    return [tokenizer.encode(text) for text in texts]


# ---------------------------------------------------------------------------- readable decoding


def decode_readable(tokenizer: Tokenizer, ids, *, final: bool = True) -> str:
    """The text of `ids` with nothing hidden: what ``decode`` would turn into U+FFFD is shown as ``<id>``.

    With a byte-level tokenizer (one with ``token_bytes``), runs of valid UTF-8 are text, and each id
    outside the vocabulary, each id of a byte run that is not UTF-8, and each id holding a control
    character other than tab and line ends (ESC would drive the terminal) is ``<id>``; EOT is dropped.
    With ``final=False`` the ids that may still begin a character (its first bytes, the rest to come)
    are left out rather than shown as ``<id>``, so the text of a growing list only ever grows. Any other
    tokenizer shows the ids from ``vocab_size`` up as ``<id>`` and decodes the rest.
    """
    pieces, run = [], []
    for token in _as_int_list(ids):
        if _has_text(tokenizer, token):
            run.append(token)
        else:
            pieces += [_readable_run(tokenizer, run, final=True), f"<{token}>"]
            run = []
    pieces.append(_readable_run(tokenizer, run, final))
    return "".join(pieces)


_CONTROL_BYTES = frozenset(range(32)) - {ord("\t"), ord("\n"), ord("\r")} | {127}  # never inside a UTF-8 character


def _has_text(tokenizer: Tokenizer, token: int) -> bool:
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if token_bytes is None:
        return 0 <= token < tokenizer.vocab_size
    data = token_bytes(token)
    return data is not None and _CONTROL_BYTES.isdisjoint(data)


def _readable_run(tokenizer: Tokenizer, run: list[int], final: bool) -> str:
    """The text of ids in the vocabulary."""
    if not hasattr(tokenizer, "token_bytes"):
        text = tokenizer.decode(run)
        return text if final else text.rstrip("\ufffd")  # an incomplete character: its next id completes it
    return _utf8_text([(token, data) for token in run if (data := tokenizer.token_bytes(token))], final)


def _utf8_text(run: list[tuple[int, bytes]], final: bool) -> str:
    """(id, bytes) pairs as text: valid UTF-8 as text, each id holding bytes that are not as <id>."""
    text = []
    while run:
        data = b"".join(piece for _, piece in run)
        try:
            text.append(data.decode("utf-8"))
            break
        except UnicodeDecodeError as error:
            ends = list(itertools.accumulate(len(piece) for _, piece in run))
            first = bisect.bisect_right(ends, error.start)  # the id holding the first bad byte
            last = bisect.bisect_right(ends, error.end - 1)  # and the last
            text.append(_utf8_text(run[:first], final=True))  # valid, unless a multi-byte id ends mid-character
            if not final and error.end == len(data) and error.reason == "unexpected end of data":
                break  # the start of a character: wait for the rest
            text.extend(f"<{token}>" for token, _ in run[first : last + 1])
            run = run[last + 1 :]
    return "".join(text)
