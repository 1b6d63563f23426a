"""Tokenizers: a minimal protocol, a dependency-free byte tokenizer, and a registry.

Everything in atma_titan that needs a tokenizer depends only on the ``Tokenizer``
protocol (``name``, ``vocab_size``, ``eot_id``, ``encode``, ``decode``), so a new
tokenizer is added by writing a factory and registering it in ``_FACTORIES``:

    def _gpt2() -> Tokenizer: ...
    _FACTORIES["gpt2"] = _gpt2

``build_tokenizer(name)`` is the single entry point used by configs.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol, runtime_checkable

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "build_tokenizer",
    "available_tokenizers",
]

_REPLACEMENT_UTF8 = "\ufffd".encode("utf-8")


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

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eot_id=256)"


# name -> zero-argument factory. Adding a tokenizer is one factory plus one entry here.
_FACTORIES: dict[str, Callable[[], Tokenizer]] = {
    "byte": ByteTokenizer,
}


def available_tokenizers() -> list[str]:
    """Names accepted by ``build_tokenizer``, sorted."""
    return sorted(_FACTORIES)


def build_tokenizer(name: str) -> Tokenizer:
    """Construct the tokenizer registered under ``name``.

    Raises ``ValueError`` naming the unknown value and the allowed names.
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        allowed = ", ".join(repr(n) for n in available_tokenizers())
        raise ValueError(f"unknown tokenizer {name!r}; allowed: {allowed}")
    return factory()
