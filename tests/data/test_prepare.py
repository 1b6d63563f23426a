import json
import subprocess
import sys

import numpy as np
import pytest

from atma_titan.data.prepare import Job, prepare
from atma_titan.prepare import main
from atma_titan.data.shards import BinShards


def corpus(tmp_path, files=3, docs=20):
    texts = []
    for f in range(files):
        with open(tmp_path / f"part{f}.jsonl", "w") as out:
            for d in range(docs):
                text = f"document {f}-{d}: " + "words " * (d % 7 + 1)
                texts.append(text)
                out.write(json.dumps({"text": text}) + "\n")
    return str(tmp_path / "part*.jsonl"), texts


def job(pattern, out, **kw):
    args = dict(
        source="text",
        path=pattern,
        hf_config="",
        hf_split="train",
        text_field="text",
        tokenizer="byte",
        out=str(out),
        parts=4,
        shard_tokens=500,
        val_tokens=0,
    )
    return Job(**{**args, **kw})


def test_prepare_writes_every_document_once_with_a_manifest(tmp_path):
    pattern, texts = corpus(tmp_path)
    manifest = prepare(job(pattern, tmp_path / "out"), progress=False)
    assert manifest["documents"] == len(texts) and manifest["tokenizer"]["vocab_size"] == 257
    shards = BinShards(str(tmp_path / "out" / "train_*.bin"))
    assert shards.num_tokens == manifest["train_tokens"] == sum(len(t.encode()) + 1 for t in texts)
    assert all(s["tokens"] <= 500 for s in manifest["train_shards"])
    stream = shards.window(0, shards.num_tokens)
    eot = np.flatnonzero(stream == 256)
    decoded = {bytes(stream[a + 1 : b].astype(np.uint8)).decode() for a, b in zip(eot, [*eot[1:], len(stream)])}
    assert decoded == set(texts)  # every document exactly once, EOT before each


def test_rerun_skips_done_parts_and_redoes_unfinished_ones(tmp_path, capsys):
    pattern, _ = corpus(tmp_path)
    out = tmp_path / "out"
    first = prepare(job(pattern, out), progress=False)
    (out / "parts" / "part-0002.json").unlink()  # as if part 2 had died before finishing
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("train_*.bin")}
    again = prepare(job(pattern, out), progress=False)
    assert "3 of 4 parts already done" in capsys.readouterr().err
    assert again == first
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("train_*.bin")}
    rewritten = {n for n in after if after[n] != before[n]}
    assert rewritten and all(n.startswith("train_0002_") for n in rewritten)


def test_validation_tokens_and_parallel_workers_to_an_fsspec_url(tmp_path):
    import fsspec

    pattern, texts = corpus(tmp_path)
    manifest = prepare(job(pattern, "memory://prep/out", val_tokens=100), workers=1, progress=False)
    assert manifest["val_tokens"] >= 100 and manifest["val_shards"][0]["name"] == "val_000.bin"
    assert manifest["train_tokens"] + manifest["val_tokens"] == sum(len(t.encode()) + 1 for t in texts)
    assert fsspec.filesystem("memory").exists("/prep/out/manifest.json")
    local = prepare(job(pattern, tmp_path / "par"), workers=2, progress=False)
    assert local["train_tokens"] == sum(len(t.encode()) + 1 for t in texts)


def test_command_line_errors_exit_nonzero_with_a_message(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "atma_titan.prepare",
            "--path",
            str(tmp_path / "none*.jsonl"),
            "--out",
            str(tmp_path / "o"),
            "--tokenizer",
            "byte",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "no file matches" in proc.stderr
    assert main(["--path", "x", "--out", "y", "--tokenizer", "nope"]) == 2


@pytest.mark.parametrize("tokenizer", ["byte"])
def test_command_line_runs_end_to_end(tmp_path, tokenizer):
    pattern, texts = corpus(tmp_path, files=2, docs=5)
    assert (
        main(
            [
                "--path",
                pattern,
                "--out",
                str(tmp_path / "cli"),
                "--tokenizer",
                tokenizer,
                "--parts",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "cli" / "manifest.json").read_text())["documents"] == len(texts)


def test_the_validation_split_reports_its_real_size_and_why(tmp_path, capsys):
    pattern, _ = corpus(tmp_path, files=2, docs=5)
    args = ["--path", pattern, "--out", str(tmp_path / "o"), "--tokenizer", "byte", "--parts", "1", "--no-progress"]
    assert main([*args, "--val-tokens", "10"]) == 0
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    line = capsys.readouterr().out.splitlines()[-1]
    assert manifest["val_tokens"] > 10  # whole documents
    assert line == (
        f"validation: {manifest['val_tokens']:,} tokens in 1 shard(s) (--val-tokens 10): whole documents are set "
        "aside, so the last one runs past the limit"
    )


def test_help_shows_every_default():
    proc = subprocess.run(
        [sys.executable, "-m", "atma_titan.prepare", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for default in ("(default: 16)", "(default: 100000000)", "(default: gpt2)", "(default: 0)", "(default: text)"):
        assert default in text, default
