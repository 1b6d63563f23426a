"""Data: tokenizers, token sources, and the loaders that split them across data-parallel ranks.

Two kinds of source feed training:
- random access (`window(i, length)`): the built-in synthetic source and llm.c `.bin` shards. The
  global window stream is split per step across ranks, and its position is one number, so resume
  is exact at any world size and any number of loader workers;
- streaming documents (text files, Hugging Face datasets): tokenised and packed on the fly, split
  by document across ranks x workers; resume is exact at the same world size and worker count.
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath

import fsspec

from atma_titan.data.synthetic import SyntheticSource
from atma_titan.data.tokenizer import Tokenizer, build_tokenizer
from atma_titan.errors import InputError

RANDOM_ACCESS = ("synthetic", "bin")


class DataConfigError(InputError):
    """The `[data]` section names data that does not fit: a missing path, a vocabulary the model lacks."""


def check_vocab(tokenizer_name: str, tokenizer_vocab: int, vocab_size: int) -> None:
    if tokenizer_vocab > vocab_size:
        raise DataConfigError(
            f"tokenizer '{tokenizer_name}' has {tokenizer_vocab:,} ids but model.vocab_size is {vocab_size:,}: "
            "raise model.vocab_size (e.g. 50304 for gpt2) or choose data.tokenizer to match the model"
        )


def shard_manifest(pattern: str) -> dict | None:
    """The prepare command's manifest.json beside the shards, if there is one."""
    fs, path = fsspec.core.url_to_fs(pattern)
    manifest = str(PurePosixPath(path).parent / "manifest.json")
    return json.loads(fs.cat(manifest)) if fs.exists(manifest) else None


def _require_path(cfg, what: str) -> None:
    if not cfg.path:
        raise DataConfigError(f"data.source = '{cfg.source}' needs data.path: {what}")


def _tokenizer(cfg, vocab_size: int) -> Tokenizer:
    tokenizer = build_tokenizer(cfg.tokenizer)
    check_vocab(cfg.tokenizer, tokenizer.vocab_size, vocab_size)
    return tokenizer


def build_source(cfg, vocab_size: int):
    """The random-access source named by `[data] source` (synthetic or bin)."""
    if cfg.source == "synthetic":
        return SyntheticSource(vocab_size, eot_id=_tokenizer(cfg, vocab_size).eot_id, seed=cfg.seed)
    if cfg.source == "bin":
        from atma_titan.data.shards import BinShards

        _require_path(cfg, "a glob or URL of .bin shards, e.g. data/finewebedu10B/finewebedu_train_*.bin")
        manifest = shard_manifest(cfg.path)
        if manifest:  # shards made by the prepare command: check their tokenizer before training
            check_vocab(manifest["tokenizer"]["name"], manifest["tokenizer"]["vocab_size"], vocab_size)
        return BinShards(cfg.path, vocab_size=vocab_size)  # and every window's ids, as they are read
    raise DataConfigError(f"data.source = '{cfg.source}' is not a random-access source")


def build_document_source(cfg):
    from atma_titan.data.documents import HFDataset, TextFiles

    if cfg.source == "text":
        _require_path(cfg, "a glob or URL of .txt / .jsonl / .parquet files")
        return TextFiles(cfg.path, cfg.text_field)
    _require_path(cfg, "a Hugging Face dataset id, e.g. HuggingFaceFW/fineweb-edu")
    return HFDataset(cfg.path, cfg.hf_config or None, cfg.hf_split, cfg.text_field)


class TrainData:
    """The training data named by `[data]`, opened and checked (files, shards, tokenizer, vocabulary) up front,
    so bad input fails before a model is built; `loader()` then makes this rank's loader."""

    def __init__(self, cfg, vocab_size: int):
        self.cfg = cfg
        self.random_access = cfg.source in RANDOM_ACCESS
        if self.random_access:
            self.source = build_source(cfg, vocab_size)
        else:
            self.source, self.tokenizer = build_document_source(cfg), _tokenizer(cfg, vocab_size)

    def loader(
        self,
        *,
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        start_window: int,
        pin_memory: bool,
    ):
        """A StatefulDataLoader of (inputs, labels) micro-batches (plus loss weights with data.recall_weight);
        random-access sources start at `start_window` (a position in the global stream, valid at any world size)."""
        from atma_titan.data.loader import build_dataloader
        from atma_titan.data.packing import build_text_dataloader

        workers = self.cfg.num_workers
        if self.random_access:
            return build_dataloader(
                self.source,
                seq_len,
                global_batch,
                micro_batch,
                rank=rank,
                world_size=world_size,
                start_window=start_window,
                num_workers=workers,
                pin_memory=pin_memory,
                recall_weight=self.cfg.recall_weight,
            )
        return build_text_dataloader(
            self.source,
            self.tokenizer,
            seq_len,
            micro_batch,
            rank=rank,
            world_size=world_size,
            num_workers=workers,
            pin_memory=pin_memory,
        )


__all__ = [
    "DataConfigError",
    "SyntheticSource",
    "TrainData",
    "build_source",
    "build_tokenizer",
    "check_vocab",
]
