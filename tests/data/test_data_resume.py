"""Every source through the training loader at 1 and 2 ranks, stopped and resumed: the resumed stream
equals the uninterrupted one token for token."""

import json

import numpy as np
import pytest
import torch

from atma_titan.config import Data
from atma_titan.data import TrainData
from atma_titan.data.shards import write_shard

SEQ, MICRO, GLOBAL = 16, 2, 4  # 2 ranks x 1 micro-batch, or 1 rank x 2 micro-batches, per step


def texts(n=60):
    return [f"document {d} " + "abc " * (d % 11 + 1) for d in range(n)]


def make_source(kind, tmp_path):
    cfg = dict(
        source=kind,
        path="",
        val_path="",
        hf_config="",
        hf_split="train",
        text_field="text",
        tokenizer="byte",
        seed=3,
        num_workers=0,
    )
    if kind == "bin":
        rng = np.random.default_rng(0)
        for i in range(2):
            write_shard(str(tmp_path / f"train_{i}.bin"), rng.integers(0, 257, 3000, dtype=np.uint16))
        cfg["path"] = str(tmp_path / "train_*.bin")
    elif kind in ("jsonl", "parquet", "txt"):
        docs = texts()
        for f in range(4):
            part = docs[f::4]
            if kind == "jsonl":
                (tmp_path / f"d{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
            elif kind == "parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.table({"text": part}), tmp_path / f"d{f}.parquet")
        if kind == "txt":
            for d, t in enumerate(docs):
                (tmp_path / f"d{d:03d}.txt").write_text(t)
        cfg.update(source="text", path=str(tmp_path / f"d*.{kind}"))
    return Data(**cfg)  # the real [data] section: every key the loaders read has its default


def loader(data, rank, world):
    return data.loader(
        seq_len=SEQ,
        global_batch=GLOBAL,
        micro_batch=MICRO,
        rank=rank,
        world_size=world,
        start_window=0,
        pin_memory=False,
    )


def take(it, n):
    return [next(it)[0].clone() for _ in range(n)]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["synthetic", "bin", "jsonl", "parquet", "txt"])
def test_stop_and_resume_gives_the_same_tokens(tmp_path, kind, world):
    data = TrainData(make_source(kind, tmp_path), vocab_size=512)
    for rank in range(world):
        straight = loader(data, rank, world)
        it = iter(straight)
        before = take(it, 5)
        state = straight.state_dict()
        expected = take(it, 7)
        resumed = loader(TrainData(make_source(kind, tmp_path), vocab_size=512), rank, world)
        resumed.load_state_dict(state)
        got = take(iter(resumed), 7)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), (kind, world, rank)
        assert not torch.equal(before[-1], expected[0])


@pytest.mark.parametrize("kind", ["synthetic", "bin"])
def test_random_access_sources_resume_from_the_global_position_at_another_world_size(tmp_path, kind):
    """What the trainer does when the world size changed: rebuild from `windows consumed`."""
    data = TrainData(make_source(kind, tmp_path), vocab_size=512)
    one_rank = take(iter(loader(data, 0, 1)), 6)  # 3 steps of 2 micro-batches
    steps_done = 1
    for rank in range(2):
        resumed = data.loader(
            seq_len=SEQ,
            global_batch=GLOBAL,
            micro_batch=MICRO,
            rank=rank,
            world_size=2,
            start_window=steps_done * GLOBAL,
            pin_memory=False,
        )
        rank_batches = take(iter(resumed), 2)
        for step in range(2):  # rank r's batch of each later step is the r-th half of that step's batch
            assert torch.equal(rank_batches[step], one_rank[(steps_done + step) * 2 + rank])
