"""The evaluation command (ATMA.md section 7): induction needle and length curve of one checkpoint.

    python -m atma_titan.eval --checkpoint PATH [--config FILE.toml] [--step N] [--out DIR]
        [--gaps 2048,4096,...] [--depths 0,0.1,0.5,0.9] [--trials 20] [--seed 0] [--passkey]
        [--haystack filler|data] [--allow-concat] [--no-needle]
        [--length-curve] [--lengths 2K,4K,...] [--documents 8]
        [--device auto] [--max-length 65536] [--batch-tokens N] [--attention-block N] [--name LABEL]

PATH: a DCP step directory, a run's checkpoint folder (its newest complete step, or --step N), a
run's dump folder, or an exported .safetensors file. The model is built from the run's
config.toml (or --config), unsharded on one device. Writes results.json, results.md, needle.png
and length_curve.png to --out (default <run>/eval/). Bad input exits with status 2 and a message.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from atma_titan.config import ConfigError
from atma_titan.data import DataConfigError, check_vocab
from atma_titan.data.documents import DataSourceError
from atma_titan.data.shards import ShardError
from atma_titan.data.tokenizer import TokenizerError, build_tokenizer
from atma_titan.data.synthetic import SyntheticSource
from atma_titan.eval.common import EvalInputError, parse_sizes, size_label
from atma_titan.eval.corpus import DocumentHaystack, FillerHaystack, LongDocuments, corpus_from_config
from atma_titan.eval.length import length_curve, length_sequences
from atma_titan.eval.loading import load_eval_model, load_run_config, pick_eval_device, resolve_checkpoint
from atma_titan.eval.needle import NEEDLE_SLACK, digit_tokens, run_needle
from atma_titan.eval.records import run_records
from atma_titan.eval.report import write_results
from atma_titan.models import resolve_model_args

# Bad input: the message says what is wrong and what to do; exit status 2.
BAD_INPUT = (EvalInputError, ConfigError, DataConfigError, DataSourceError, ShardError, TokenizerError)

DEFAULT_GAPS = "2K,4K,8K,16K,32K,64K"
DEFAULT_LENGTHS = "2K,4K,8K,16K,32K,64K"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m atma_titan.eval",
        description="Induction needle (teacher-forced) and length curve of an ATMA checkpoint (ATMA.md section 7).",
    )
    p.add_argument("--checkpoint", required=True, help="step dir, checkpoint folder, dump folder, or .safetensors")
    p.add_argument("--config", help="the run's TOML config (default: config.toml of the run folder)")
    p.add_argument("--step", type=int, help="checkpoint step to load from a folder (default: newest complete)")
    p.add_argument("--out", help="output folder (default: <run>/eval)")
    p.add_argument("--name", help="label of this model in results and plots (default: the run folder's name)")
    p.add_argument(
        "--gaps", default=DEFAULT_GAPS, help=f"needle gaps in tokens, e.g. 2048,4096 or 2K,4K (default {DEFAULT_GAPS})"
    )
    p.add_argument("--depths", default="0", help="needle depths: 0 = before the haystack, 0.1/0.5/0.9 = inside it")
    p.add_argument("--trials", type=int, default=20, help="trials per gap and depth (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the record numbers and values (default 0)")
    p.add_argument("--passkey", action="store_true", help="also run the passkey variant (cue ' The pass key is')")
    p.add_argument("--haystack", choices=("filler", "data"), default="filler", help="passkey filler or the run's data")
    p.add_argument(
        "--records",
        action="store_true",
        help="the needle in the built-in synthetic language (for models trained on data.source = synthetic)",
    )
    p.add_argument("--allow-concat", action="store_true", help="join documents with EOT when none is long enough")
    p.add_argument("--no-needle", action="store_true", help="skip the needle (e.g. for a length curve only)")
    p.add_argument("--length-curve", action="store_true", help="also compute the NLL-vs-length curve")
    p.add_argument(
        "--lengths", default=DEFAULT_LENGTHS, help=f"prefix lengths of the curve (default {DEFAULT_LENGTHS})"
    )
    p.add_argument("--documents", type=int, default=8, help="documents in the length curve (default 8)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda or cuda:N")
    p.add_argument("--max-length", type=int, default=65536, help="longest gap or length allowed (default 65536)")
    p.add_argument("--batch-tokens", type=int, default=1 << 17, help="tokens per forward pass (default 131072)")
    p.add_argument(
        "--attention-block",
        type=int,
        help="Polar reference tile for this evaluation (default: the run's). Same math; a larger tile takes far "
        "fewer steps at long lengths (the debug flavor's 64 makes 64K slow), memory grows as T x tile",
    )
    return p.parse_args(argv)


def _check_sizes(sizes: list[int], what: str, max_length: int) -> None:
    too_long = [s for s in sizes if s > max_length]
    if too_long:
        raise EvalInputError(
            f"{what} {', '.join(map(str, too_long))} longer than --max-length {max_length}; "
            "raise --max-length if the device has the memory for it"
        )


def _depths(text: str) -> list[float]:
    try:
        depths = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EvalInputError(f"--depths {text!r}: expected numbers like 0,0.1,0.5,0.9") from None
    bad = [d for d in depths if not 0 <= d < 1]
    if not depths or bad:
        raise EvalInputError(f"--depths {text!r}: each depth must be in [0, 1) (0 = needle before the haystack)")
    return depths


def evaluate(args: argparse.Namespace) -> tuple[dict, Path]:
    """Run the evaluation; returns (results in the results.json schema, output folder).

    Input is checked first (sizes, checkpoint, config, tokenizer, digits, data) so bad input costs
    no model load.
    """
    needle_on = not args.no_needle
    gaps = parse_sizes(args.gaps, "--gaps") if needle_on else []
    lengths = sorted(set(parse_sizes(args.lengths, "--lengths"))) if args.length_curve else []
    depths = _depths(args.depths)
    _check_sizes(gaps, "gap(s)", args.max_length)
    _check_sizes(lengths, "length(s)", args.max_length)
    if args.trials < 1 or args.documents < 1:
        raise EvalInputError("--trials and --documents must be >= 1")
    if not needle_on and not args.length_curve:
        raise EvalInputError("nothing to do: --no-needle without --length-curve")

    resolved = resolve_checkpoint(args.checkpoint, args.step)
    cfg = load_run_config(resolved, args.config)
    if args.attention_block:
        if args.attention_block < 1:
            raise EvalInputError(f"--attention-block must be >= 1, got {args.attention_block}")
        cfg.model.attention_block = args.attention_block  # a tiling choice of the reference kernel only
    vocab_size = resolve_model_args(cfg.model).vocab_size
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    check_vocab(cfg.data.tokenizer, tokenizer.vocab_size, vocab_size)
    if args.records and cfg.data.source != "synthetic":
        raise EvalInputError(
            f"--records probes the synthetic source's language; this run trained on "
            f"data.source = '{cfg.data.source}': use the text needle instead"
        )
    text_needle = needle_on and not args.records
    if text_needle:
        digit_tokens(tokenizer)  # raises on digits that are not single tokens, before the model loads
    corpus = corpus_from_config(cfg.data, tokenizer, vocab_size) if (args.haystack == "data" or lengths) else None

    device = pick_eval_device(args.device)
    began = time.perf_counter()
    model = load_eval_model(cfg, resolved, device)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"loaded {resolved.path} (step {resolved.step}): {params:,} parameters on {device} "
        f"in {time.perf_counter() - began:.1f} s; tokenizer {tokenizer.name}",
        flush=True,
    )

    def progress(line: str) -> None:
        print(line, flush=True)

    needle = []
    if needle_on and args.records:
        source = SyntheticSource(vocab_size, eot_id=tokenizer.eot_id, seed=cfg.data.seed)
        print(
            f"needle: synthetic records, gaps {', '.join(map(size_label, gaps))}, {args.trials} trials each", flush=True
        )
        results = run_records(
            model,
            source,
            gaps=gaps,
            trials=args.trials,
            seed=args.seed,
            batch_tokens=args.batch_tokens,
            progress=progress,
        )
        needle = [r.as_dict() for r in results]
    elif needle_on:
        if args.haystack == "filler":
            haystack = FillerHaystack(tokenizer)
        else:
            docs = LongDocuments(
                corpus,
                min_tokens=min(gaps) + NEEDLE_SLACK,
                max_tokens=max(gaps) + NEEDLE_SLACK,
                allow_concat=args.allow_concat,
            )
            haystack = DocumentHaystack(docs)
        variants = ["access"] + (["passkey"] if args.passkey else [])
        print(
            f"needle: {len(variants)} variant(s) x {len(depths)} depth(s) x gaps "
            f"{', '.join(map(size_label, gaps))}, {args.trials} trials each, haystack: {haystack.describe}",
            flush=True,
        )
        results = run_needle(
            model,
            tokenizer,
            haystack,
            gaps=gaps,
            depths=depths,
            variants=variants,
            trials=args.trials,
            seed=args.seed,
            batch_tokens=args.batch_tokens,
            progress=progress,
        )
        needle = [r.as_dict() for r in results]

    curve = None
    if lengths:
        longest = lengths[-1]
        docs = LongDocuments(corpus, min_tokens=longest - 1, max_tokens=longest - 1, allow_concat=args.allow_concat)
        sequences = length_sequences(docs, tokenizer.eot_id, longest, args.documents)
        print(
            f"length curve: {args.documents} documents from {corpus.describe}, lengths "
            f"{', '.join(map(size_label, lengths))}",
            flush=True,
        )
        curve = length_curve(model, sequences, lengths, batch_tokens=args.batch_tokens, progress=progress).as_dict()

    return {
        "name": args.name or resolved.run_dir.resolve().name,
        "checkpoint": os.path.abspath(resolved.path),
        "step": resolved.step,
        "tokenizer": tokenizer.name,
        "needle": needle,
        "length_curve": curve,
    }, (Path(args.out) if args.out else resolved.run_dir / "eval")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        results, out_dir = evaluate(args)
    except BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in write_results(results, out_dir).values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
