"""A text source trained on 2 ranks, resumed on 1, then on 2 again (torchrun, gloo): the run trains no document
twice and leaves none out. Every document starts with its own id token (a word-level tokenizer), and the
trainer records the windows each rank's loop took (tests/support/record_batches.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from distributed_utils import ROOT, TINY

pytestmark = pytest.mark.slow

FILES, PER_FILE = 3, 120
EOT, FILLER, FIRST_ID = 0, 1, 2  # token ids of the word-level vocabulary


def word_tokenizer(path: Path) -> str:
    """A tokenizer.json with one token per document id ("d17"), a filler word "w" and <|endoftext|>."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": EOT, "w": FILLER, **{f"d{i}": FIRST_ID + i for i in range(FILES * PER_FILE)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return str(path)


def id_corpus(folder: Path) -> str:
    """FILES jsonl files; document d of file f is "d<f*PER_FILE+d> w w ..." (1-30 filler words)."""
    folder.mkdir()
    rng = random.Random(0)
    for f in range(FILES):
        with open(folder / f"part{f}.jsonl", "w") as out:
            for d in range(PER_FILE):
                words = " ".join(["w"] * rng.randint(1, 30))
                out.write(json.dumps({"text": f"d{f * PER_FILE + d} {words}"}) + "\n")
    return str(folder / "*.jsonl")


def train(nproc: int, record: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if nproc > 1:
        launcher.append(f"--nproc_per_node={nproc}")
    cmd = [*launcher, str(ROOT / "tests" / "support" / "record_batches.py"), str(record), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def documents_trained(record: Path, num_workers: int = 0) -> list[int]:
    """Ids of the documents whose leading EOT was an input token of a window a rank's loop took."""
    ids = []
    for path in sorted(record.glob("rank-*.jsonl")):
        batches = [json.loads(line) for line in path.read_text().splitlines()]
        for worker in range(max(num_workers, 1)):  # one stream per part; the loader takes its workers in turn
            windows = [np.asarray(w) for batch in batches[worker :: max(num_workers, 1)] for w in batch]
            stream = np.concatenate([windows[0], *(w[1:] for w in windows[1:])])  # consecutive windows share a token
            starts = np.flatnonzero(stream[:-1] == EOT)  # the last token was only a label
            ids += [int(stream[i + 1]) - FIRST_ID for i in starts]
    return ids


def assert_no_repeats_and_no_gaps(segments: list[list[int]]) -> None:
    assert all(len(ids) > 10 for ids in segments)  # 1-31 tokens a document
    trained = [d for ids in segments for d in ids]
    assert len(trained) == len(set(trained)), "a document was trained twice"
    # None left out: each file is read in order by one part at a time, so what was trained of it is a prefix.
    for f in range(FILES):
        mine = sorted(d - f * PER_FILE for d in trained if d // PER_FILE == f)
        assert mine == list(range(len(mine))), f"file {f}: {mine}"


def test_text_stream_trained_on_2_then_1_then_2_ranks_repeats_no_document(tmp_path):
    common = [
        *TINY,
        "--data.source", "text",
        "--data.path", id_corpus(tmp_path / "text"),
        "--data.tokenizer", word_tokenizer(tmp_path / "tokenizer.json"),
        "--checkpoint.enable", "true",
        "--checkpoint.interval", "100",
        "--job.dump_folder", str(tmp_path / "run"),
    ]  # fmt: skip
    segments = []
    for nproc, steps in ((2, 4), (1, 8), (2, 12)):
        record = tmp_path / f"until-step-{steps}"
        proc = train(nproc, record, *common, "--training.steps", str(steps))
        if steps > 4:
            assert "continues from the checkpoint's document cursor" in proc.stdout, proc.stdout
            assert "restarts from its beginning" not in proc.stdout
        segments.append(documents_trained(record))
    assert_no_repeats_and_no_gaps(segments)


def test_hf_stream_continues_at_another_number_of_loader_workers(tmp_path, monkeypatch, capsys):
    """A local json dataset through data.source = 'hf': 1 part, then 1 rank x 2 loader workers = 2 parts."""
    pytest.importorskip("datasets")
    import atma_titan.train as trainer
    from atma_titan.config import load_config
    from record_batches import recording

    id_corpus(tmp_path / "text")
    common = [
        *TINY,
        "--metrics.stdout", "false",
        "--data.source", "hf",
        "--data.path", str(tmp_path / "text"),
        "--data.tokenizer", word_tokenizer(tmp_path / "tokenizer.json"),
        "--checkpoint.enable", "true",
        "--checkpoint.interval", "100",
        "--job.dump_folder", str(tmp_path / "run"),
    ]  # fmt: skip
    segments, original = [], trainer.open_loader
    for workers, steps in ((0, 4), (2, 8)):
        record = tmp_path / f"until-step-{steps}"
        monkeypatch.setattr(trainer, "open_loader", recording(original, record))
        trainer.train(load_config([*common, "--data.num_workers", str(workers), "--training.steps", str(steps)]))
        segments.append(documents_trained(record, workers))
    assert "continues from the checkpoint's document cursor, saved by 1 part " in capsys.readouterr().out
    assert_no_repeats_and_no_gaps(segments)
