"""The evaluation command (docs/model.md section 7): induction needle and length curve of one checkpoint.

    python -m atma_titan.eval --checkpoint PATH [--config FILE.toml] [--step N] [--out DIR]
        [--gaps 2048,4096,...] [--depths 0,0.1,0.5,0.9] [--trials 20] [--seed 0] [--passkey]
        [--haystack filler|data] [--records | --text-needle] [--generate] [--allow-concat] [--no-needle]
        [--length-curve] [--lengths 2K,4K,...] [--documents 8]
        [--device auto] [--max-length 65536] [--batch-tokens N] [--attention-block N] [--name LABEL]

PATH: a DCP step directory, a run's checkpoint folder (its newest complete step, or --step N), a
run's dump folder, or an exported .safetensors file. The model is built from the run's
config.toml (or --config), unsharded on one device. Writes results.json, results.md, needle.png
and length_curve.png to --out (default <run>/eval/). Bad input exits with status 2 and a message.

Which needle: a model trained on the synthetic source (its config's data.source) gets --records at 1x, 4x
and 16x its training length unless the command asks for the text needle (--text-needle, --passkey or
--haystack data): the text needle's prose and digits are not its language. Any other model gets the text
needle at 2K..64K. When the records needle is chosen so, the first line printed says it and why.

The needle is teacher-forced by default: one greedy prediction per value digit with the true digits
fed, plus its CE and the control's CE. `--generate` reads it the way passkeys usually are: the model is
given the sequence up to the query's value and writes the value itself, greedily and free-running, with
the generation engine's KV cache (atma_titan.inference); the tokens it writes are compared with the
value (digit acc: each digit in its place; exact: the whole value, the byte tokenizer's spaces
included). No CE and no control then; the needle rows of results.json say "mode": "generated"
(teacher-forced ones "teacher_forced"). With --records the same holds for the synthetic record's value
after its `MARK key`, and `--depths` places the synthetic record inside the haystack as it does the text
needle (one row per gap and depth). On CUDA the Linear weights are then stored in bf16 for the engine
(what autocast computes anyway).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from atma_titan.data.synthetic import SyntheticSource
from atma_titan.utils.cli import add_checkpoint_arguments, command, command_parser
from atma_titan.utils.device import resolve_device
from atma_titan.eval.common import EvalInputError, parse_sizes, size_label
from atma_titan.eval.corpus import DocumentHaystack, FillerHaystack, LongDocuments, corpus_from_config
from atma_titan.eval.length import length_curve, length_sequences
from atma_titan.checkpoint.open import (
    OpenCheckpoint,
    ResolvedCheckpoint,
    load_eval_model,
    open_checkpoint,
    resolve_checkpoint,
)
from atma_titan.run.folder import COMPLETE_NAME, RunFolder, complete_steps, is_complete, step_dirs
from atma_titan.eval.needle import NEEDLE_SLACK, digit_tokens, run_needle
from atma_titan.eval.records import run_records
from atma_titan.eval.report import RESULT_UNITS, write_results
from atma_titan.models import ModelArgs

DEFAULT_GAPS = "2K,4K,8K,16K,32K,64K"  # the text needle's
# --records' default gaps, times the training length: at it, and well past it, where a model that learned
# only to copy inside its training window fails (the README's debug check: 256, 1K, 4K)
RECORDS_GAP_MULTIPLES = (1, 4, 16)
DEFAULT_LENGTHS = "2K,4K,8K,16K,32K,64K"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = command_parser(
        "eval",
        "Induction needle (teacher-forced, or generated with --generate) and length curve of an ATMA "
        "checkpoint (docs/model.md section 7).",
    )
    add_checkpoint_arguments(p)
    p.add_argument("--out", help="output folder (default: <run>/eval)")
    p.add_argument("--name", help="label of this model in results and plots (default: the run folder's name)")
    p.add_argument(
        "--gaps",
        help="needle gaps in tokens, e.g. 2048,4096 or 2K,4K (default: 2K..64K for the text needle; 1x, 4x and 16x "
        "the training length for --records)",
    )
    p.add_argument(
        "--depths",
        default="0",
        help="needle depths, the fraction of the gap's haystack before the needle: 0 = before the haystack, "
        "0.1/0.5/0.9 = inside it (the text needle and --records)",
    )
    p.add_argument("--trials", type=int, default=20, help="trials per gap and depth")
    p.add_argument("--seed", type=int, default=0, help="seed of the record numbers and values")
    p.add_argument("--passkey", action="store_true", help="also run the passkey variant (cue ' The pass key is')")
    p.add_argument("--haystack", choices=("filler", "data"), default="filler", help="passkey filler or the run's data")
    p.add_argument(
        "--records",
        action="store_true",
        help="the needle in the built-in synthetic language (the default for a model trained on data.source = "
        "synthetic)",
    )
    p.add_argument(
        "--text-needle",
        action="store_true",
        help="the text needle even on a model trained on data.source = synthetic (whose default is --records)",
    )
    p.add_argument(
        "--generate",
        action="store_true",
        help="score the value the model generates (greedy, free-running, with the KV cache) after the query's cue "
        "instead of teacher-forced digits: digit and exact accuracy, no CE and no control; results say "
        'mode "generated"',
    )
    p.add_argument(
        "--generate-gaps",
        help="also score the generated value (as --generate) at these gaps, after the teacher-forced needle at "
        "--gaps: both readings in one results.json",
    )
    p.add_argument(
        "--no-control",
        action="store_true",
        help="skip the teacher-forced needle's control (the same sequence without the needle): half the work, "
        "no control CE",
    )
    p.add_argument(
        "--steps",
        help="evaluate the needle at each of these checkpoint steps of a run, e.g. 150,300 or 'all' (every complete "
        "one): recall over training, in results.json's over_training; the length curve and the top-level numbers "
        "are the last step's",
    )
    p.add_argument("--allow-concat", action="store_true", help="join documents with EOT when none is long enough")
    p.add_argument("--no-needle", action="store_true", help="skip the needle (e.g. for a length curve only)")
    p.add_argument("--length-curve", action="store_true", help="also compute the NLL-vs-length curve")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prefix lengths of the curve")
    p.add_argument("--documents", type=int, default=8, help="documents in the length curve")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda or cuda:N")
    p.add_argument("--max-length", type=int, default=65536, help="longest gap or length allowed")
    p.add_argument("--batch-tokens", type=int, default=1 << 17, help="tokens per forward pass")
    p.add_argument(
        "--attention-block",
        type=int,
        help="Polar reference tile for this evaluation (default: the run's). Same math; a larger tile takes far "
        "fewer steps at long lengths (the debug flavor's 64 makes 64K slow), memory grows as T x tile",
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Argument checks: bad input costs no model load


@dataclass(frozen=True)
class Request:
    """The checked arguments: what to measure."""

    gaps: list[int]  # [] without the needle, or until chosen for the model (no --gaps)
    lengths: list[int]  # [] without the length curve
    depths: list[float]
    records: bool = False  # the synthetic records needle, else the text needle
    generate_gaps: list[int] = dataclasses.field(default_factory=list)  # also generated, after the teacher-forced
    steps: list[int] | str | None = None  # --steps: the checkpoint steps to evaluate, "all", or None (one step)


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


def check_arguments(args: argparse.Namespace) -> Request:
    needle_on = not args.no_needle
    gaps = parse_sizes(args.gaps, "--gaps") if needle_on and args.gaps is not None else []
    generate_gaps = parse_sizes(args.generate_gaps, "--generate-gaps") if args.generate_gaps else []
    lengths = sorted(set(parse_sizes(args.lengths, "--lengths"))) if args.length_curve else []
    depths = _depths(args.depths)
    _check_sizes(gaps + generate_gaps, "gap(s)", args.max_length)
    _check_sizes(lengths, "length(s)", args.max_length)
    if args.trials < 1 or args.documents < 1:
        raise EvalInputError("--trials and --documents must be >= 1")
    if not needle_on and not args.length_curve:
        raise EvalInputError("nothing to do: --no-needle without --length-curve")
    if args.batch_tokens < 1:
        raise EvalInputError(f"--batch-tokens must be >= 1, got {args.batch_tokens}")
    if args.generate and not needle_on:
        raise EvalInputError("--generate scores the needle: drop --no-needle, or --generate")
    if args.attention_block is not None and args.attention_block < 1:
        raise EvalInputError(f"--attention-block must be >= 1, got {args.attention_block}")
    if args.records and args.text_needle:
        raise EvalInputError("--records and --text-needle are two different needles: choose one")
    if generate_gaps and (args.generate or not needle_on):
        raise EvalInputError(
            "--generate-gaps adds generated rows to the teacher-forced needle: drop --generate or --no-needle, "
            "or --generate-gaps"
        )
    steps = _steps(args.steps, args.step, needle_on)
    return Request(gaps, lengths, depths, records=args.records, generate_gaps=generate_gaps, steps=steps)


def _steps(text: str | None, step: int | None, needle_on: bool) -> list[int] | str | None:
    if text is None:
        return None
    if step is not None:
        raise EvalInputError("--step is one checkpoint and --steps several: choose one")
    if not needle_on:
        raise EvalInputError("--steps evaluates the needle over training: drop --no-needle, or --steps")
    if text.strip() == "all":
        return "all"
    try:
        steps = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise EvalInputError(f"--steps {text!r}: expected checkpoint steps like 150,300,450 or 'all'") from None
    if not steps or steps[0] < 0:
        raise EvalInputError(f"--steps {text!r}: expected checkpoint steps >= 0 like 150,300,450 or 'all'")
    return steps


def checkpoint_steps(path: str, wanted: list[int] | str) -> tuple[Path, list[int]]:
    """The checkpoint folder of the run at `path` and the complete steps of `wanted` ("all": every one).

    Only lists the folder: each step is verified when it loads, not here as well."""
    given = Path(path)
    if given.is_file() or is_complete(given):
        raise EvalInputError(f"--steps needs a run folder or its checkpoint folder; {path} is one checkpoint")
    folder = given if step_dirs(given) else RunFolder.of(given).checkpoints
    have = complete_steps(folder)
    if not have:
        raise EvalInputError(f"--steps: no complete checkpoint (step-<n>/{COMPLETE_NAME}) under {folder}")
    if wanted == "all":
        return folder, have
    missing = [s for s in wanted if s not in have]
    if missing:
        raise EvalInputError(
            f"--steps: no complete checkpoint for step(s) {', '.join(map(str, missing))} under {folder}; complete "
            f"steps: {', '.join(map(str, have))}"
        )
    return folder, list(wanted)


def choose_needle(args: argparse.Namespace, request: Request, cfg) -> tuple[Request, str | None]:
    """The needle and gaps the command line left open, chosen for the model (`cfg`: its run config).

    Returns the request and, when the records needle was chosen for the user, the line that says so."""
    if args.no_needle:
        return request, None
    asks_text = args.text_needle or args.passkey or args.haystack == "data"
    records = args.records or (cfg.data.source == "synthetic" and not asks_text)
    gaps = request.gaps
    seq_len = int(cfg.training.seq_len)
    if args.gaps is None:
        gaps = [m * seq_len for m in RECORDS_GAP_MULTIPLES] if records else parse_sizes(DEFAULT_GAPS)
        gaps = [g for g in gaps if g <= args.max_length] or gaps[:1]
        _check_sizes(gaps, "gap(s)", args.max_length)
    chosen = dataclasses.replace(request, gaps=gaps, records=records)
    if not records or args.records:
        return chosen, None
    multiples = ", ".join(f"{g / seq_len:g}x" for g in gaps)
    return chosen, (
        f"needle: --records at gaps {', '.join(map(size_label, gaps))} ({multiples} the training length "
        f"{seq_len}): this model was trained on data.source = 'synthetic', not on text; add --text-needle for "
        "the text needle"
    )


@dataclass
class Inputs:
    """The checkpoint and everything read from its run: config, model shape, tokenizer, data."""

    resolved: ResolvedCheckpoint
    cfg: object  # the run's JobConfig
    model_args: ModelArgs
    tokenizer: object
    corpus: object  # a TokenCorpus, when the haystack or the length curve reads the run's data


def open_inputs(args: argparse.Namespace, request: Request, opened: OpenCheckpoint) -> Inputs:
    """Config, tokenizer, digits and data (of the OpenCheckpoint `opened`) are all checked before the model
    loads."""
    resolved, cfg, tokenizer = opened.resolved, opened.cfg, opened.tokenizer
    model_args = opened.model_args
    if args.attention_block:  # a tiling choice of the reference kernel only
        model_args = dataclasses.replace(model_args, attention_block=args.attention_block)
    if request.records and cfg.data.source != "synthetic":
        raise EvalInputError(
            f"--records probes the synthetic source's language; this run trained on "
            f"data.source = '{cfg.data.source}': use the text needle instead"
        )
    if request.gaps and not request.records:
        digit_tokens(tokenizer)  # raises on digits that are not single tokens
    corpus = None
    if args.haystack == "data" or request.lengths:
        corpus = corpus_from_config(cfg.data, tokenizer, model_args.vocab_size)
    return Inputs(resolved, cfg, model_args, tokenizer, corpus)


# ---------------------------------------------------------------------------------------------
# The sections


def _progress(line: str) -> None:
    print(line, flush=True)


def needle_section(args: argparse.Namespace, request: Request, inputs: Inputs, model) -> list[dict]:
    """The needle's rows: at --gaps (teacher-forced, or generated with --generate), then generated at
    --generate-gaps."""
    rows = _needle(args, request, inputs, model, request.gaps, generate=args.generate)
    return rows + _needle(args, request, inputs, model, request.generate_gaps, generate=True)


def _needle(args, request: Request, inputs: Inputs, model, gaps: list[int], *, generate: bool) -> list[dict]:
    """The records needle (synthetic-trained models) or the text needle over variants x depths x `gaps`."""
    if not gaps:
        return []
    gaps_text = ", ".join(map(size_label, gaps))
    how = "generated, greedy free-running" if generate else "teacher-forced"
    if generate and next(model.parameters()).device.type == "cuda":
        from atma_titan.inference import cast_for_inference

        cast_for_inference(model, torch.bfloat16)  # as the generate command does; autocast computes in bf16 anyway
    common = dict(
        depths=request.depths, trials=args.trials, seed=args.seed, batch_tokens=args.batch_tokens, progress=_progress,
        generate=generate, control=not args.no_control,
    )  # fmt: skip
    if request.records:
        source = SyntheticSource(
            inputs.model_args.vocab_size, eot_id=inputs.tokenizer.eot_id, seed=inputs.cfg.data.seed
        )
        print(
            f"needle ({how}): synthetic records, {len(request.depths)} depth(s) x gaps {gaps_text}, "
            f"{args.trials} trials each",
            flush=True,
        )
        return [r.as_dict() for r in run_records(model, source, gaps=gaps, **common)]
    if args.haystack == "filler":
        haystack = FillerHaystack(inputs.tokenizer)
    else:
        docs = LongDocuments(
            inputs.corpus,
            min_tokens=min(gaps) + NEEDLE_SLACK,
            max_tokens=max(gaps) + NEEDLE_SLACK,
            allow_concat=args.allow_concat,
        )
        haystack = DocumentHaystack(docs)
    variants = ["access"] + (["passkey"] if args.passkey else [])
    print(
        f"needle ({how}): {len(variants)} variant(s) x {len(request.depths)} depth(s) x gaps {gaps_text}, "
        f"{args.trials} trials each, haystack: {haystack.describe}",
        flush=True,
    )
    results = run_needle(model, inputs.tokenizer, haystack, gaps=gaps, variants=variants, **common)
    return [r.as_dict() for r in results]


def length_section(args: argparse.Namespace, request: Request, inputs: Inputs, model) -> dict | None:
    """Mean NLL per token on nested prefixes of the same long documents."""
    if not request.lengths:
        return None
    longest = request.lengths[-1]
    docs = LongDocuments(inputs.corpus, min_tokens=longest - 1, max_tokens=longest - 1, allow_concat=args.allow_concat)
    sequences = length_sequences(docs, inputs.tokenizer.eot_id, longest, args.documents)
    print(
        f"length curve: {args.documents} documents from {inputs.corpus.describe}, lengths "
        f"{', '.join(map(size_label, request.lengths))}",
        flush=True,
    )
    return length_curve(model, sequences, request.lengths, batch_tokens=args.batch_tokens, progress=_progress).as_dict()


def evaluate(args: argparse.Namespace) -> tuple[dict, Path]:
    """Run the evaluation; returns (results in the results.json schema, output folder)."""
    request = check_arguments(args)
    folder, steps = checkpoint_steps(args.checkpoint, request.steps) if request.steps else (args.checkpoint, [])
    opened = open_checkpoint(folder, steps[-1] if steps else args.step, args.config)
    request, chosen = choose_needle(args, request, opened.cfg)
    if chosen:
        print(chosen, flush=True)
    inputs = open_inputs(args, request, opened)
    device = resolve_device(args.device, what="--device")
    over_training = []  # every step but the last, which is the results' own
    for step in steps[:-1]:
        earlier = _load(inputs, resolve_checkpoint(folder, step), device)
        over_training.append({"step": step, "needle": needle_section(args, request, inputs, earlier)})
    model = _load(inputs, inputs.resolved, device)
    resolved = inputs.resolved
    results = {
        "name": args.name or resolved.run_dir.resolve().name,
        "checkpoint": os.path.abspath(resolved.path),
        "step": resolved.step,
        "tokenizer": inputs.tokenizer.name,
        "train_seq_len": int(inputs.cfg.training.seq_len),  # marked on the plots
        "units": dict(RESULT_UNITS),
        "needle": needle_section(args, request, inputs, model),
        "length_curve": length_section(args, request, inputs, model),
    }
    if steps:
        results["over_training"] = over_training + [{"step": resolved.step, "needle": results["needle"]}]
    return results, (Path(args.out) if args.out else resolved.run_dir / "eval")


def _load(inputs: Inputs, resolved: ResolvedCheckpoint, device: torch.device):
    began = time.perf_counter()
    model = load_eval_model(inputs.model_args, resolved, device)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"loaded {resolved.path} (step {resolved.step}): {params:,} parameters on {device} "
        f"in {time.perf_counter() - began:.1f} s; tokenizer {inputs.tokenizer.name}",
        flush=True,
    )
    return model


@command
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    results, out_dir = evaluate(args)
    for path in write_results(results, out_dir).values():
        print(f"wrote {path}")
    print(f"evaluated {results['name']} in {time.perf_counter() - began:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
