r"""The data preparation command: tokenise a dataset into llm.c `.bin` shards (atma_titan.data.prepare).

    python -m atma_titan.prepare --source hf --path HuggingFaceFW/fineweb-edu --hf-config sample-10BT \
        --tokenizer gpt2 --out s3://bucket/fineweb-edu-gpt2 --parts 64 --workers 16
    python -m atma_titan.prepare --source text --path "corpus/*.jsonl" --tokenizer gpt2 --out data/corpus
"""

from __future__ import annotations

import argparse
import sys
import time

from atma_titan.data import prepare as preparation
from atma_titan.utils.cli import command, command_parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # The usage above, then the rules of the output folder (resume, the plan) as the module states them.
    rules = preparation.__doc__.split("\n\n", 1)[1]
    p = command_parser("prepare", f"{__doc__}\n{rules}", verbatim=True)
    p.add_argument("--source", choices=("text", "hf"), default="text", help="text files or a Hugging Face dataset")
    p.add_argument("--path", required=True, help="text: glob/URL of .txt/.jsonl/.parquet files; hf: hub id")
    p.add_argument("--hf-config", default="", help="hf: config name (e.g. sample-10BT)")
    p.add_argument("--hf-split", default="train", help="hf: split")
    p.add_argument("--text-field", default="text", help="field holding the text (jsonl, parquet, hf)")
    p.add_argument("--tokenizer", default="gpt2", help="byte, gpt2, or a tokenizer.json path / hf:<hub id>")
    p.add_argument("--out", required=True, help="destination folder: local path or fsspec URL (s3://, gs://, ...)")
    p.add_argument("--parts", type=int, default=16, help="input split into this many independently resumable parts")
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per output shard at most")
    p.add_argument(
        "--val-tokens", type=int, default=0, help="tokens of part 0 to set aside as val_000.bin (whole documents)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("parts", "workers", "shard_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


@command
def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    job = preparation.Job(
        a.source, a.path, a.hf_config, a.hf_split, a.text_field, a.tokenizer, a.out, a.parts, a.shard_tokens,
        a.val_tokens,
    )  # fmt: skip
    began = time.time()
    manifest = preparation.prepare(job, a.workers, progress=not a.no_progress)
    print(
        f"wrote {len(manifest['train_shards'])} train shards ({manifest['train_tokens']:,} tokens) and "
        f"{len(manifest['val_shards'])} validation shards ({manifest['val_tokens']:,} tokens) of "
        f"{manifest['documents']:,} documents to {a.out} in {time.time() - began:.1f} s"
    )
    print(preparation.validation_note(job, manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
