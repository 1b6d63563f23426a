"""The lm-evaluation-harness command: evaluate one ATMA checkpoint on harness tasks.

    python -m atma_titan.lm_eval --checkpoint PATH --tasks t1,t2 [--limit N] [--batch-size B]
        [--num-fewshot K] [--include-path DIR] [--no-builtin-tasks] [--metadata JSON] [--out DIR] [--log-samples]
        [--device auto] [--step N] [--config FILE.toml] [--max-length N] [--seed 0] [--bootstrap-iters N]

PATH is any checkpoint the eval command takes (a DCP step directory, a checkpoint folder, a run
folder, an exported .safetensors file). Tasks are the harness's names (or glob patterns) and those of
the task YAMLs under --include-path. Runs `lm_eval.simple_evaluate` with the "atma_titan" model,
prints the harness's results table and writes results.json (and with --log-samples one
samples_<task>.jsonl per task) to --out (default <run>/lm_eval/). Bad input (a missing checkpoint,
an unknown task: the message lists close matches) exits with status 2 and a message, as does a task
whose Hugging Face data set is neither cached nor downloadable: when the Hub does not answer (or
HF_HUB_OFFLINE=1), the tasks read the local cache only, at once (atma_titan.lm_eval.offline).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
from pathlib import Path

from atma_titan.utils.cli import add_checkpoint_arguments, command, command_parser
from atma_titan.utils.errors import InputError, import_optional


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = command_parser("lm_eval", "Evaluate an ATMA checkpoint on lm-evaluation-harness tasks (model 'atma_titan').")
    add_checkpoint_arguments(p)
    p.add_argument("--tasks", required=True, help="comma-separated task names or glob patterns")
    p.add_argument("--limit", type=float, help="examples per task (a fraction if < 1); for quick checks")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass and decoded at once")
    p.add_argument("--max-length", type=int, help="longest sequence fed to the model (default: training.seq_len)")
    p.add_argument("--include-path", action="append", help="a folder of task YAMLs (repeatable)")
    p.add_argument(
        "--no-builtin-tasks",
        action="store_true",
        help="index only the tasks under --include-path (indexing the harness's own tasks takes seconds)",
    )
    p.add_argument(
        "--metadata",
        help='JSON object passed to the tasks, e.g. \'{"max_seq_lengths": [4096, 8192]}\' for RULER (default: none; '
        'its "tokenizer", the Hugging Face tokenizer RULER sizes its prompts with, is the run\'s hf:<id> tokenizer '
        "unless given)",
    )
    p.add_argument("--out", help="output folder (default: <run>/lm_eval)")
    p.add_argument("--log-samples", action="store_true", help="also write every example's prompt and outputs")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of the harness (few-shot sampling) and of the sampler")
    p.add_argument("--bootstrap-iters", type=int, default=100000, help="bootstrap samples of the stderr estimates")
    return p.parse_args(argv)


def check_arguments(args: argparse.Namespace) -> None:
    for flag, value in (("--batch-size", args.batch_size), ("--max-length", args.max_length)):
        if value is not None and value < 1:
            raise InputError(f"{flag} {value} is invalid; allowed: an integer >= 1")
    if args.limit is not None and args.limit <= 0:
        raise InputError(f"--limit {args.limit} is invalid; allowed: a count >= 1 or a fraction in (0, 1)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise InputError(f"--num-fewshot {args.num_fewshot} is invalid; allowed: an integer >= 0")
    for folder in args.include_path or []:
        if not Path(folder).is_dir():
            raise InputError(f"--include-path {folder}: no such folder")
    if args.no_builtin_tasks and not args.include_path:
        raise InputError("--no-builtin-tasks needs --include-path (there would be no task at all)")


def task_metadata(text: str | None, tokenizer_name: str) -> dict:
    """--metadata as a dict, with "tokenizer" filled in from a hub tokenizer (hf:<id>) when not given."""
    metadata = {}
    if text:
        try:
            metadata = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"--metadata {text!r} is not JSON ({e.msg})") from None
        if not isinstance(metadata, dict):
            raise InputError(f"--metadata {text!r}: expected a JSON object")
    if "tokenizer" not in metadata and tokenizer_name.startswith("hf:"):
        metadata["tokenizer"] = tokenizer_name[len("hf:") :]
    return metadata


def task_names(text: str, task_manager) -> list[str]:
    """The harness tasks that `text` ("a,b*,c") names; an unknown name raises with its close matches."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise InputError(f"--tasks {text!r} names no task")
    found, unknown = [], []
    for name in names:
        matches = task_manager.match_tasks([name])
        if not matches:
            unknown.append(name)
        found += [m for m in matches if m not in found]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, task_manager.all_tasks, n=5, cutoff=0.6)
            hints.append(f"{name!r} (close matches: {', '.join(close)})" if close else f"{name!r} (no close match)")
        raise InputError(
            f"unknown task(s): {'; '.join(hints)}. `lm_eval ls tasks` lists the harness's tasks; "
            "--include-path DIR adds task YAMLs"
        )
    return found


def write_outputs(results: dict, out_dir: Path, log_samples: bool) -> list[Path]:
    """results.json (without the samples) and, with log_samples, samples_<task>.jsonl per task."""
    from lm_eval.utils import handle_non_serializable

    out_dir.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples", None)
    written = [out_dir / "results.json"]
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    written[0].write_text(text + "\n", encoding="utf-8")
    if log_samples and samples:
        for task, rows in samples.items():
            path = out_dir / f"samples_{task}.jsonl"
            with path.open("w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n")
            written.append(path)
    return written


def evaluate(args: argparse.Namespace) -> tuple[dict, Path]:
    """Run the harness; returns (its results, the output folder)."""
    check_arguments(args)
    lm_eval = import_optional("lm_eval", "lm_eval", "python -m atma_titan.lm_eval", package="lm-eval")
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import setup_logging

    from atma_titan.checkpoint.open import open_checkpoint
    from atma_titan.lm_eval.adapter import register
    from atma_titan.lm_eval.offline import hub_or_cache, missing_task_data
    from atma_titan.lm_eval.scorer import AtmaScorer

    setup_logging()  # the harness's progress lines, as its own command prints them
    opened = open_checkpoint(args.checkpoint, args.step, args.config)  # bad input exits before tasks are indexed
    metadata = task_metadata(args.metadata, opened.tokenizer.name)
    print("indexing tasks ...", flush=True)
    task_manager = TaskManager(
        include_path=args.include_path, include_defaults=not args.no_builtin_tasks, metadata=metadata
    )
    tasks = task_names(args.tasks, task_manager)
    began = time.perf_counter()
    scorer = AtmaScorer.from_opened(
        opened, device=args.device, batch_size=args.batch_size, max_length=args.max_length, seed=args.seed
    )
    params = sum(p.numel() for p in scorer.model.parameters())
    print(
        f"loaded {scorer.checkpoint.path} (step {scorer.checkpoint.step}): {params:,} parameters on {scorer.device} "
        f"in {time.perf_counter() - began:.1f} s; tokenizer {scorer.tokenizer.name}, max_length {scorer.max_length}",
        flush=True,
    )
    lm = register()(scorer=scorer)
    with hub_or_cache() as offline:  # offline, the tasks read the cache at once (no 40 s of retries)
        try:
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=tasks,
                num_fewshot=args.num_fewshot,
                batch_size=args.batch_size,
                device=str(scorer.device),
                limit=int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit,
                bootstrap_iters=args.bootstrap_iters,
                log_samples=args.log_samples,
                task_manager=task_manager,
                random_seed=args.seed,
                numpy_random_seed=args.seed,
                torch_random_seed=args.seed,
                fewshot_random_seed=args.seed,
            )
        except Exception as error:
            problem = missing_task_data(error, offline)
            if problem is None:
                raise
            raise InputError(problem) from None
    results["config"]["model_args"] = {"checkpoint": str(args.checkpoint), "step": opened.resolved.step}
    return results, (Path(args.out) if args.out else opened.resolved.run_dir / "lm_eval")


@command
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    results, out_dir = evaluate(args)
    from lm_eval.utils import make_table

    table = make_table(results)
    groups = make_table(results, "groups") if "groups" in results else None
    for path in write_outputs(results, out_dir, args.log_samples):
        print(f"wrote {path}")
    print(table)
    if groups:
        print(groups)
    print(f"evaluated {args.checkpoint} in {time.perf_counter() - began:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
