"""Training on every kind of data source, and the errors a user sees for bad data."""

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import SMALL as TRAIN_SMALL

from atma_titan.config import load_config
from atma_titan.data.prepare import Job, prepare
from atma_titan.data.shards import write_shard
from atma_titan.train import train

SMALL = [*TRAIN_SMALL, "--metrics.stdout", "false"]


def jsonl_corpus(folder, files=2, docs=30):
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(folder / f"docs{f}.jsonl", "w") as out:
            for d in range(docs):
                out.write(json.dumps({"text": f"Record {f}.{d} says hello. " * (d % 5 + 2)}) + "\n")
    return str(folder / "docs*.jsonl")


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "atma_titan.train", *SMALL, *args], capture_output=True, text=True, timeout=300
    )


def test_train_on_prepared_bin_shards(tmp_path):
    pattern = jsonl_corpus(tmp_path / "text")
    prepare(Job("text", pattern, "", "train", "text", "byte", str(tmp_path / "shards"), 2, 2000, 0), progress=False)
    last = train(
        load_config(
            SMALL
            + [
                "--job.dump_folder",
                str(tmp_path / "run"),
                "--data.source",
                "bin",
                "--data.path",
                str(tmp_path / "shards" / "train_*.bin"),
            ]
        )
    )
    assert last["step"] == 3 and np.isfinite(last["loss"])


@pytest.mark.parametrize("source", ["text", "hf"])
def test_train_on_streamed_documents(tmp_path, source):
    if source == "hf":
        pytest.importorskip("datasets")
    pattern = jsonl_corpus(tmp_path / "text")
    path = pattern if source == "text" else str(tmp_path / "text")  # hf: a local dataset folder
    last = train(
        load_config(
            SMALL
            + [
                "--job.dump_folder",
                str(tmp_path / "run"),
                "--data.source",
                source,
                "--data.path",
                path,
                "--data.num_workers",
                "1",
            ]
        )
    )
    assert last["step"] == 3 and np.isfinite(last["loss"])


def test_missing_shards_exit_with_the_pattern_named(tmp_path):
    proc = run(
        "--data.source",
        "bin",
        "--data.path",
        str(tmp_path / "nothing_*.bin"),
        "--job.dump_folder",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 2 and "nothing_*.bin" in proc.stderr and "Traceback" not in proc.stderr


def test_bin_source_without_a_path_is_a_config_error(tmp_path):
    proc = run("--data.source", "bin", "--job.dump_folder", str(tmp_path / "run"))
    assert proc.returncode == 2 and "needs data.path" in proc.stderr


def test_bad_shard_header_names_the_file(tmp_path):
    (tmp_path / "bad.bin").write_bytes(b"\x00" * 2048)
    proc = run(
        "--data.source", "bin", "--data.path", str(tmp_path / "bad.bin"), "--job.dump_folder", str(tmp_path / "run")
    )
    assert proc.returncode == 2 and "bad.bin" in proc.stderr and "magic" in proc.stderr


def test_token_beyond_the_vocabulary_names_the_shard(tmp_path):
    write_shard(str(tmp_path / "big_ids.bin"), np.full(10_000, 600, dtype=np.uint16))  # debug vocab is 512
    proc = run(
        "--data.source", "bin", "--data.path", str(tmp_path / "big_ids.bin"), "--job.dump_folder", str(tmp_path / "run")
    )
    assert proc.returncode == 2 and "big_ids.bin" in proc.stderr and "600" in proc.stderr


def test_tokenizer_larger_than_the_model_vocabulary_fails_before_training(tmp_path):
    pattern = jsonl_corpus(tmp_path / "text")
    prepare(Job("text", pattern, "", "train", "text", "byte", str(tmp_path / "shards"), 1, 10_000, 0), progress=False)
    proc = run(
        "--data.source",
        "bin",
        "--data.path",
        str(tmp_path / "shards" / "train_*.bin"),
        "--model.vocab_size",
        "200",
        "--job.dump_folder",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 2 and "257" in proc.stderr and "model.vocab_size" in proc.stderr


def test_missing_text_field_names_the_file(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.jsonl").write_text('{"body": "hello"}\n')
    proc = run(
        "--data.source",
        "text",
        "--data.path",
        str(tmp_path / "t" / "a.jsonl"),
        "--job.dump_folder",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 2 and "a.jsonl" in proc.stderr and "'text'" in proc.stderr and "body" in proc.stderr
