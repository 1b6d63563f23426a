"""Tokenise a dataset into llm.c `.bin` shards, part by part (the command: `python -m atma_titan.prepare`).

The input is split into `--parts` parts (the document sources' deterministic split); each part is
tokenised by one worker process into shards `train_<part>_<k>.bin` of at most `--shard-tokens`
tokens, written atomically. A part counts as done only when all its shards are written and its
record `parts/part-<part>.json` exists; re-running skips done parts and redoes the others from
scratch, so an interrupted run resumes. The first `--val-tokens` tokens of part 0 go to
`val_000.bin`. When every part is done, `manifest.json` lists the shards, their token counts and
the tokenizer (name, vocab size, EOT id); training checks it against the model.

The first run writes its plan to `plan.json`: everything that decides which documents a part
holds and how it is written (the source and its input files, the text field, the tokenizer,
`--parts`, `--shard-tokens`, `--val-tokens`, the split rule). A re-run with another plan is refused
(exit status 2, naming what differs): its parts would overlap the folder's and repeat or lose
documents. Re-run with the folder's settings to resume it, or start over in a new or empty folder.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass

import fsspec
import numpy as np

from atma_titan.data.documents import SPLIT_VERSION, DataSourceError, EmptyPartError, HFDataset, TextFiles
from atma_titan.data.shards import write_shard
from atma_titan.data.tokenizer import build_tokenizer, encode_batch
from atma_titan.utils.errors import InputError

MANIFEST = "manifest.json"
PLAN = "plan.json"
PARTS_DIR = "parts"


class PlanMismatch(InputError):
    """The output folder was started with another plan (parts, tokenizer, inputs, ...) than this run's."""


@dataclass(frozen=True)
class Job:
    source: str
    path: str
    hf_config: str
    hf_split: str
    text_field: str
    tokenizer: str
    out: str
    parts: int
    shard_tokens: int
    val_tokens: int
    batch_documents: int = 256

    def document_source(self):
        if self.source == "hf":
            return HFDataset(self.path, self.hf_config or None, self.hf_split, self.text_field)
        return TextFiles(self.path, self.text_field)


def _join(root: str, *names: str) -> str:
    return "/".join([root.rstrip("/"), *names])


def _write_json(fs, path: str, data: dict) -> None:
    """Write whole-or-nothing: a temporary name, then a rename."""
    with fs.open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
    fs.mv(path + ".tmp", path)


class _ShardWriter:
    """Collects tokens and writes a shard each time `shard_tokens` have accumulated."""

    def __init__(self, job: Job, prefix: str):
        self.job, self.prefix = job, prefix
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            room = self.job.shard_tokens - self.buffered
            self.buffer.append(tokens[:room])
            self.buffered += len(tokens[:room])
            tokens = tokens[room:]
            if self.buffered == self.job.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self.buffered:
            return
        name = f"{self.prefix}_{len(self.shards):03d}.bin"
        count = write_shard(_join(self.job.out, name), np.concatenate(self.buffer))
        self.shards.append({"name": name, "tokens": int(count)})
        self.buffer, self.buffered = [], 0


# ---------------------------------------------------------------------------- the plan

# Plan entry -> how to name it in a message (the command-line flag that sets it).
_PLAN_FLAGS = {
    "source": "--source",
    "dataset": "--path",
    "hf_config": "--hf-config",
    "hf_split": "--hf-split",
    "text_field": "--text-field",
    "parts": "--parts",
    "shard_tokens": "--shard-tokens",
    "val_tokens": "--val-tokens",
}


def job_plan(job: Job, source, tokenizer) -> dict:
    """What decides the output folder's contents; a text source's inputs are its files, not the pattern's spelling."""
    plan = {
        "split": SPLIT_VERSION,
        "source": job.source,
        "inputs": {"files": source.num_files, "fingerprint": source.fingerprint()},
        "text_field": job.text_field,
        "tokenizer": {"name": job.tokenizer, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id},
        "parts": job.parts,
        "shard_tokens": job.shard_tokens,
        "val_tokens": job.val_tokens,
    }
    if job.source == "hf":
        plan.update(dataset=job.path, hf_config=job.hf_config, hf_split=job.hf_split)
    return plan


def plan_differences(ours: dict, theirs: dict) -> list[str]:
    """Human-readable differences between this run's plan and the folder's."""
    out = []
    for key in sorted(set(ours) | set(theirs)):
        now, then = ours.get(key), theirs.get(key)
        if now == then:
            continue
        if key == "inputs":
            now_files, then_files = (now or {}).get("files"), (then or {}).get("files")
            what = (
                f"{now_files} files now, {then_files} when the folder was started"
                if now_files != then_files
                else f"{now_files} files under other names than when the folder was started"
            )
            out.append(f"the input files (--path): {what}")
        elif key == "tokenizer":
            out.append(f"--tokenizer: {_tokenizer_text(now)} now, {_tokenizer_text(then)} in the folder")
        elif key == "split":
            out.append(f"the split rule of atma_titan: version {now} now, {then} in the folder")
        else:
            out.append(f"{_PLAN_FLAGS.get(key, key)}: {now!r} now, {then!r} in the folder")
    return out


def _tokenizer_text(tokenizer: dict | None) -> str:
    if not tokenizer:
        return "none"
    return f"{tokenizer['name']!r} (vocab {tokenizer['vocab_size']:,}, EOT {tokenizer['eot_id']})"


def _has_output(fs, root: str) -> bool:
    """Whether the folder holds prepare output (part records, shards or a manifest)."""
    records, shards = fs.glob(_join(root, PARTS_DIR, "part-*.json")), fs.glob(_join(root, "*.bin"))
    return bool(records or shards or fs.exists(_join(root, MANIFEST)))


def check_plan(job: Job, fs, root: str, plan: dict) -> None:
    """Record this run's plan in a new folder; refuse a folder started with another one (PlanMismatch)."""
    path = _join(root, PLAN)
    if not fs.exists(path):
        if _has_output(fs, root):
            raise PlanMismatch(
                f"{job.out} holds prepare output without a {PLAN} (written by an older atma_titan), so whether this "
                f"run's plan matches it cannot be checked. Start over: remove {job.out} or choose another --out"
            )
        _write_json(fs, path, plan)
        return
    differences = plan_differences(plan, json.loads(fs.cat(path)))
    if differences:
        raise PlanMismatch(
            f"{job.out} was started with another plan ({'; '.join(differences)}): its parts and this run's would "
            "overlap and repeat or lose documents. Re-run with the folder's settings to resume it, or start over: "
            f"remove {job.out} or choose another --out"
        )


# ---------------------------------------------------------------------------- the parts


def _one_pass(job: Job, part: int):
    """This part's documents, once (sources repeat epochs for training; a part may be empty)."""
    try:
        for text, state in job.document_source().documents(part, job.parts):
            if state["epoch"] > 0:
                return
            yield text
    except EmptyPartError:
        return


def _tokenised_documents(job: Job, part: int, tokenizer):
    """This part's documents as token arrays, each with EOT in front (llm.c convention)."""
    batch: list[str] = []
    for text in _one_pass(job, part):
        batch.append(text)
        if len(batch) == job.batch_documents:
            yield from _encode(tokenizer, batch)
            batch = []
    if batch:
        yield from _encode(tokenizer, batch)


def _encode(tokenizer, texts: list[str]):
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    for ids in encode_batch(tokenizer, texts):
        yield np.asarray([tokenizer.eot_id, *ids], dtype=dtype)


def prepare_part(job: Job, part: int) -> dict:
    """Tokenise one part into its shards; returns its record (also written to parts/part-N.json)."""
    tokenizer = build_tokenizer(job.tokenizer)
    train = _ShardWriter(job, f"train_{part:04d}")
    val = _ShardWriter(job, "val") if part == 0 and job.val_tokens else None
    documents = 0
    for tokens in _tokenised_documents(job, part, tokenizer):
        documents += 1
        if val is not None and val.buffered + sum(s["tokens"] for s in val.shards) < job.val_tokens:
            val.add(tokens)  # whole documents: validation text never starts mid-document
        else:
            train.add(tokens)
    train.flush()
    record = {"part": part, "documents": documents, "shards": train.shards}
    if val is not None:
        val.flush()
        record["val_shards"] = val.shards
    fs, root = fsspec.core.url_to_fs(job.out)
    _write_json(fs, _join(root, PARTS_DIR, f"part-{part:04d}.json"), record)
    return record


def _run_part(args: tuple[Job, int]) -> dict:
    return prepare_part(*args)


def prepare(job: Job, workers: int = 1, progress: bool = True) -> dict:
    """Run every part not yet done (in `workers` processes), then write and return the manifest."""
    tokenizer = build_tokenizer(job.tokenizer)  # fail fast (offline, unknown name) before any worker starts
    source = job.document_source()  # and a missing input, before anything is written
    fs, root = fsspec.core.url_to_fs(job.out)
    fs.makedirs(_join(root, PARTS_DIR), exist_ok=True)
    check_plan(job, fs, root, job_plan(job, source, tokenizer))
    done = {int(p.rsplit("-", 1)[1].split(".")[0]) for p in fs.glob(_join(root, PARTS_DIR, "part-*.json"))}
    todo = [p for p in range(job.parts) if p not in done]
    if done:
        print(f"{len(done)} of {job.parts} parts already done in {job.out}; {len(todo)} to go", file=sys.stderr)

    from tqdm import tqdm

    bar = tqdm(total=job.parts, initial=len(done), unit="part", desc="tokenising", disable=not progress)
    tokens, start = 0, time.time()
    ctx = mp.get_context("spawn")  # fork is unsafe with the threads tokenizers and fsspec start
    with ctx.Pool(workers) if workers > 1 else _InlinePool() as pool:
        for record in pool.imap_unordered(_run_part, [(job, p) for p in todo]):
            tokens += sum(s["tokens"] for s in record["shards"] + record.get("val_shards", []))
            bar.update(1)
            bar.set_postfix(tokens=f"{tokens:,}", per_s=f"{tokens / max(1e-9, time.time() - start):,.0f}")
    bar.close()

    records = [json.loads(fs.cat(p)) for p in sorted(fs.glob(_join(root, PARTS_DIR, "part-*.json")))]
    train = [s for r in records for s in r["shards"]]
    val = [s for r in records for s in r.get("val_shards", [])]
    if not train:
        raise DataSourceError(f"no documents found in {job.path}: nothing to write to {job.out}")
    manifest = {
        "format": "llm.c token shards (256 x int32 header: magic 20240520, version, count; then tokens)",
        "source": {
            "kind": job.source,
            "path": job.path,
            "hf_config": job.hf_config,
            "hf_split": job.hf_split,
            "text_field": job.text_field,
        },
        "tokenizer": {"name": job.tokenizer, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id},
        "documents": sum(r["documents"] for r in records),
        "train_tokens": sum(s["tokens"] for s in train),
        "val_tokens": sum(s["tokens"] for s in val),
        "train_shards": train,
        "val_shards": val,
    }
    _write_json(fs, _join(root, MANIFEST), manifest)
    return manifest


class _InlinePool:
    """The Pool interface, in this process: one worker needs no subprocesses."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap_unordered(self, fn, items):
        return map(fn, items)


def validation_note(job: Job, manifest: dict) -> str:
    """What the validation split holds, and why it differs from --val-tokens when it does."""
    if not job.val_tokens:
        return "no validation split (--val-tokens 0)"
    got = manifest["val_tokens"]
    line = f"validation: {got:,} tokens in {len(manifest['val_shards'])} shard(s) (--val-tokens {job.val_tokens:,})"
    if got > job.val_tokens:
        line += ": whole documents are set aside, so the last one runs past the limit"
    elif got < job.val_tokens:
        line += ": part 0 held no more documents (use fewer --parts for a larger split)"
    return line

