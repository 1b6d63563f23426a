"""Tokens/s the data loader delivers to one rank, against what training consumes, in one run.

    python benchmarks/data/data_throughput.py [--tokens 100_000_000] [--workers 0,2,4] [--world 1,8]
                                              [--paths bin,mixture,text]

Three paths: llm.c `.bin` shards (memory-mapped windows: the training path), a mixture of three `.bin`
sources (weights 0.5 / 0.3 / 0.2, data/mixture_batches.py; its rows also give the ratio to the single
source's at the same world and workers), and jsonl text tokenised on the fly (byte tokenizer, a BPE
trained here with `tokenizers`, and GPT-2 when tiktoken's files are cached). Each loader is rank 0 of
`--world` ranks, 2K sequences, micro-batches of 16, so it builds exactly the batches rank 0 would train on.
The consumption side is the 370M model's training speed per GPU: `--consume` tokens/s (default: the
recipe's on one H200, benchmarks/results/train_speed-h200-2026-12-04.json). Each figure is
the median of `--runs` timings of `--batches` micro-batches. Results go to
benchmarks/results/data_throughput-cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.data.documents import TextFiles  # noqa: E402
from atma_titan.data.loader import build_dataloader, stateful_loader  # noqa: E402
from atma_titan.data.mixture import MixtureSchedule, MixtureSpec, SourceSpec, Stage  # noqa: E402
from atma_titan.data.mixture_batches import build_mixture_dataloader  # noqa: E402
from atma_titan.data.packing import PackedBatches  # noqa: E402
from atma_titan.data.shards import BinShards, write_shard  # noqa: E402
from atma_titan.data.tokenizer import build_tokenizer  # noqa: E402
from benchmarks.common import result_path, write_json  # noqa: E402

SEQ_LEN, MICRO_BATCH, GLOBAL_BATCH = 2048, 16, 256
WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be or have had "
    "it not first one their its new after who they two her she been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can "
    "state about national out known university united then made"
).split()


def measure(loader, batches: int, runs: int = 1) -> float:
    """Tokens/s over `batches` micro-batches, after one warm-up batch (worker start-up); the median of `runs` such
    timings, one after another on the same loader."""
    it = iter(loader)
    next(it)
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(batches):
            inputs = next(it)[0]
        rates.append(batches * inputs.numel() / (time.perf_counter() - start))
    return statistics.median(rates)


def make_shards(folder: Path, tokens: int, shards: int = 4, seed: int = 0) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(shards):
        write_shard(str(folder / f"train_{i:03d}.bin"), rng.integers(0, 50257, tokens // shards, dtype=np.uint16))
    return str(folder / "train_*.bin")


def make_jsonl(folder: Path, documents: int, files: int = 8) -> str:
    rng = np.random.default_rng(1)
    for f in range(files):
        with open(folder / f"docs_{f:02d}.jsonl", "w") as out:
            for _ in range(documents // files):
                words = rng.choice(WORDS, size=int(rng.integers(200, 1500)))
                out.write(json.dumps({"text": " ".join(words) + "."}) + "\n")
    return str(folder / "docs_*.jsonl")


def train_bpe(folder: Path, pattern: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"])
    files = sorted(Path(pattern).parent.glob(Path(pattern).name))
    texts = (json.loads(line)["text"] for f in files[:1] for line in open(f))
    tok.train_from_iterator(texts, trainer)
    path = folder / "bpe" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=100_000_000, help="tokens in the .bin shards")
    p.add_argument("--documents", type=int, default=4000, help="jsonl documents (~850 words each)")
    p.add_argument("--workers", default="0,2,4")
    p.add_argument("--world", default="1,8")
    p.add_argument("--batches", type=int, default=40, help="micro-batches timed per loader")
    p.add_argument("--runs", type=int, default=5, help="timings per loader; the median is reported")
    p.add_argument("--paths", default="bin,mixture,text", help="comma-separated, from bin, mixture, text")
    p.add_argument("--consume", type=float, default=216_880.0, help="training tokens/s per GPU to compare with")
    p.add_argument("--tag", help="name the file data_throughput-<tag>.json instead")
    p.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    a = p.parse_args()
    workers = [int(w) for w in a.workers.split(",")]
    worlds = [int(w) for w in a.world.split(",")]
    paths = set(a.paths.split(","))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "text").mkdir()
        shards = BinShards(make_shards(tmp / "bin", a.tokens))
        # The mixture: three sources of a third of the tokens each (windows are read alike wherever they lie).
        names, weights = ("web", "code", "math"), (0.5, 0.3, 0.2)
        mixed = [BinShards(make_shards(tmp / name, a.tokens // 3, seed=i + 1)) for i, name in enumerate(names)]
        spec = MixtureSpec(
            tuple(SourceSpec(n, "bin", "-", weight=w) for n, w in zip(names, weights)), (Stage("main", 1, weights),), 0
        )
        single = {}
        for world in worlds:
            for w in workers:
                if "bin" in paths:
                    loader = build_dataloader(
                        shards, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, world_size=world, num_workers=w
                    )
                    rows.append({"path": ".bin shards", "world": world, "workers": w,
                                 "tokens_per_second": measure(loader, a.batches, a.runs)})  # fmt: skip
                    single[world, w] = rows[-1]["tokens_per_second"]
                    print(rows[-1], flush=True)
                if "mixture" in paths:
                    schedule = MixtureSchedule(spec, GLOBAL_BATCH)
                    loader = build_mixture_dataloader(
                        schedule, mixed, SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, names=list(names), world_size=world,
                        num_workers=w,
                    )  # fmt: skip
                    rows.append({"path": "3-source mixture", "world": world, "workers": w,
                                 "tokens_per_second": measure(loader, a.batches, a.runs)})  # fmt: skip
                    if (world, w) in single:
                        rows[-1]["vs_single_bin"] = rows[-1]["tokens_per_second"] / single[world, w]
                    print(rows[-1], flush=True)
        if "text" not in paths:
            tokenizers = {}
        else:
            pattern = make_jsonl(tmp / "text", a.documents)
            tokenizers = {"byte": "byte", "bpe-8k": train_bpe(tmp, pattern)}
            try:
                build_tokenizer("gpt2")
                tokenizers["gpt2"] = "gpt2"
            except ValueError as e:
                print(f"gpt2 skipped: {str(e).splitlines()[0]}")
        for name, spec in tokenizers.items():
            tokenizer = build_tokenizer(spec)
            for w in workers:
                dataset = PackedBatches(TextFiles(pattern), tokenizer, SEQ_LEN, MICRO_BATCH)
                rows.append(
                    {
                        "path": f"jsonl + {name}",
                        "world": 1,
                        "workers": w,
                        "tokens_per_second": measure(stateful_loader(dataset, w), max(4, a.batches // 4), a.runs),
                    }
                )
                print(rows[-1], flush=True)

    print(f"\n{'path':<18} {'world':>5} {'workers':>7} {'tokens/s/rank':>14} {'x consumption':>14} {'vs .bin':>8}")
    for r in rows:
        r["x_consumption"] = r["tokens_per_second"] / a.consume
        vs = f"{r['vs_single_bin']:.3f}" if "vs_single_bin" in r else ""
        print(
            f"{r['path']:<18} {r['world']:>5} {r['workers']:>7} {r['tokens_per_second']:>14,.0f} "
            f"{r['x_consumption']:>13.1f}x {vs:>8}"
        )
    print(f"(consumption: {a.consume:,.0f} tokens/s per GPU)")
    result = {"consume_tokens_per_second": a.consume, "results": rows}
    write_json(result_path("data_throughput", a.out, "cpu", a.tag), result)


if __name__ == "__main__":
    main()
