"""The training data named by `[data]`: its source built and checked up front (`TrainData`), the loaders it
makes for each rank, and the document cursor a checkpoint keeps of a streamed source (`StreamCursor`).

Random-access sources (synthetic, .bin shards) come from `build_source`, streamed documents (text files,
Hugging Face datasets) from `build_document_source`; a tokenizer (or .bin shards made with one) with more ids
than the model's vocabulary is refused before a model is built.
"""

from __future__ import annotations

import json

from atma_titan.data.synthetic import SyntheticSource
from atma_titan.data.tokenizer import Tokenizer, build_tokenizer, known_eot_id
from atma_titan.utils.errors import InputError

__all__ = [
    "RANDOM_ACCESS",
    "DataConfigError",
    "StreamCursor",
    "TrainData",
    "build_document_source",
    "build_source",
    "check_vocab",
    "shard_manifest",
]

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
    from atma_titan.data.remote import url_to_fs  # a missing fsspec back-end names the extra to install

    fs, path = url_to_fs(pattern, "data.path")
    manifest = f"{fs._parent(path)}/manifest.json"  # fsspec's parent: a URL's "//" survives
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
        from atma_titan.data.token_range import check_token_ids

        _require_path(cfg, "a glob or URL of .bin shards, e.g. data/finewebedu10B/finewebedu_train_*.bin")
        manifest = shard_manifest(cfg.path)
        if manifest:  # shards made by the prepare command: check their tokenizer before training
            check_vocab(manifest["tokenizer"]["name"], manifest["tokenizer"]["vocab_size"], vocab_size)
        shards = BinShards(cfg.path, vocab_size=vocab_size)  # and every window's ids, as they are read
        check_token_ids(shards, vocab_size)  # every id, before step 1 (cached per shard: data.token_range)
        return shards
    raise DataConfigError(f"data.source = '{cfg.source}' is not a random-access source")


def build_document_source(cfg):
    from atma_titan.data.documents import HFDataset, TextFiles

    if cfg.source == "text":
        _require_path(cfg, "a glob or URL of .txt / .jsonl / .parquet files")
        return TextFiles(cfg.path, cfg.text_field)
    _require_path(cfg, "a Hugging Face dataset id, e.g. HuggingFaceFW/fineweb-edu")
    return HFDataset(cfg.path, cfg.hf_config or None, cfg.hf_split, cfg.text_field)


class StreamCursor:
    """The global document cursor of a streamed source, as a DCP Stateful ("data_stream" of the checkpoint state).

    `state_dict()` is the stream plan advanced by every part's consumed position: each rank's own
    parts are all-gathered, so every rank saves the same value (DCP calls it on every rank at a
    save, a collective moment). Before the loader exists (the template of a load) it is the plan
    to start from. `load_state_dict` keeps the saved plan for the loader to continue from.
    """

    def __init__(self, data: TrainData):
        self.data = data

    def state_dict(self) -> dict:
        return {"plan": self.data.current_plan().to_json()}  # one JSON string: a single DCP entry

    def load_state_dict(self, state: dict) -> None:
        from atma_titan.data.stream_plan import StreamPlan

        plan = StreamPlan.from_json(state["plan"])
        self.data.source.check_plan(plan)
        self.data.plan = plan


def _gather_positions(local: dict[int, dict | None]) -> dict[int, dict | None]:
    from atma_titan.parallel.dims import all_gather_objects

    return {part: position for positions in all_gather_objects(local) for part, position in positions.items()}


class TrainData:
    """The training data named by `[data]`, opened and checked (files, shards, tokenizer, vocabulary) up front,
    so bad input fails before a model is built; `loader()` then makes this rank's loader."""

    def __init__(self, cfg, vocab_size: int):
        self.cfg = cfg
        self.random_access = cfg.source in RANDOM_ACCESS
        self.live_loader = None  # the streaming loader, once made
        self.num_parts = 0
        if self.random_access:
            self.source = build_source(cfg, vocab_size)
        else:
            self.source, self.tokenizer = build_document_source(cfg), _tokenizer(cfg, vocab_size)
            self.plan = self.source.fresh_plan()  # replaced by a checkpoint's (StreamCursor.load_state_dict)

    @property
    def eot_id(self) -> int:
        """The end-of-text id that begins each document (data.document_mask finds the boundaries by it): the
        tokenizer's, or for .bin shards made by the prepare command the one their manifest records."""
        if not self.random_access:
            return self.tokenizer.eot_id
        if self.cfg.source == "synthetic":
            return self.source.eot_id
        manifest = shard_manifest(self.cfg.path)
        if manifest and "eot_id" in manifest["tokenizer"]:
            return int(manifest["tokenizer"]["eot_id"])
        known = known_eot_id(self.cfg.tokenizer)  # without building it: no tokenizer files needed
        return known if known is not None else build_tokenizer(self.cfg.tokenizer).eot_id

    def checkpoint_state(self) -> dict:
        """What this data adds to the global checkpoint state: the document cursor of a streamed source."""
        return {} if self.random_access else {"data_stream": StreamCursor(self)}

    def current_plan(self):
        """The stream plan advanced by what every rank's loader has consumed (collective once a loader exists)."""
        from atma_titan.data.packing import consumed_positions

        if self.live_loader is None:
            return self.plan
        positions = _gather_positions(consumed_positions(self.live_loader))
        return self.plan.advanced(positions, self.num_parts)

    def resume_note(self) -> str:
        """Where a streamed source continues when the loader state could not be restored exactly."""
        saved = self.plan.saved_parts
        return (
            f"the {self.cfg.source} stream continues from the checkpoint's document cursor, saved by {saved} "
            f"part{'s' if saved != 1 else ''} (ranks x loader workers), now read by {self.num_parts}: every file "
            f"continues after its last trained document ({self.plan.describe()}); the untrained rest of at most "
            f"{saved} document{'s' if saved != 1 else ''} (one per old part) is skipped"
        )

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
        skips=None,
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
                skips=skips,
            )
        # Every part reads under the same plan (the checkpoint's, or the fresh one), split for ranks x workers.
        self.num_parts = world_size * max(workers, 1)
        self.plan = self.plan.split(self.num_parts)
        self.live_loader = build_text_dataloader(
            self.source,
            self.tokenizer,
            seq_len,
            micro_batch,
            rank=rank,
            world_size=world_size,
            num_workers=workers,
            pin_memory=pin_memory,
            plan=self.plan,
        )
        return self.live_loader
