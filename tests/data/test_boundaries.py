"""Where documents begin for data.document_mask: each source's EOT id (TrainData.eot_id)."""

import json

import numpy as np

from atma_titan.config import load_config
from atma_titan.data import TrainData
from atma_titan.data.shards import write_shard


def data_for(*overrides: str):
    return load_config(list(overrides)).data


def test_synthetic_and_text_take_their_tokenizers_eot(tmp_path):
    assert TrainData(data_for(), 512).eot_id == 256  # the byte tokenizer's
    (tmp_path / "a.txt").write_text("one document")
    text = data_for("--data.source", "text", "--data.path", str(tmp_path / "*.txt"))
    assert TrainData(text, 512).eot_id == 256


def test_bin_shards_take_their_manifests_eot_or_the_named_tokenizers(tmp_path):
    write_shard(str(tmp_path / "train_000.bin"), np.arange(100, dtype=np.uint16))
    shards = ["--data.source", "bin", "--data.path", str(tmp_path / "train_*.bin")]
    # no manifest: the named tokenizer's id, known without its files (GPT-2's needs a download otherwise)
    assert TrainData(data_for(*shards, "--data.tokenizer", "gpt2"), 50304).eot_id == 50256
    manifest = {"tokenizer": {"name": "custom", "vocab_size": 512, "eot_id": 7}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert TrainData(data_for(*shards), 512).eot_id == 7
