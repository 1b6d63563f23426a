"""The generation command: sample text from a trained ATMA checkpoint.

    python -m atma_titan.generate --checkpoint PATH (--prompt TEXT | --prompts FILE.jsonl)
        [--max-new-tokens 128] [--temperature 0.8] [--top-k 200] [--top-p 1.0] [--seed 0]
        [--batch-size 8] [--max-context N] [--page-size 16] [--no-cache] [--no-cuda-graphs] [--compile]
        [--device auto] [--config FILE.toml] [--step N] [--out FILE.jsonl] [--show-ids]

PATH is any checkpoint the eval command takes (a DCP step directory, a checkpoint folder, a run
folder, an exported .safetensors file); the model and tokenizer come from the run's config.toml.
Each prompt starts with the EOT id, as every training document does. `--prompt` streams the text
to stdout as it is produced; `--prompts` reads one JSON object per line ({"prompt": "..."}, or a
bare JSON string) and writes one JSON line per prompt, as each finishes, to --out (default stdout):
{"index", "prompt", "text", "prompt_tokens", "new_tokens", "finish": "eot" | "length", "seconds"}
("seconds": from the prompt's first new token, which follows its prefill, to its last). An id the
tokenizer has no text for is shown as <id> (the debug model's synthetic language writes ids 257-511,
beyond the byte tokenizer's 0-256), as are bytes that are not UTF-8 and control characters other than
tab and line ends (data, not commands to the terminal). `--show-ids` also prints the
generated ids: a line "ids: 311 402 ..." after the text of `--prompt`, an "ids" list in each JSON line.
`--temperature 0` is greedy decoding. `--no-cache` recomputes the full forward for every token
(slow; for checking the cache). `--compile` compiles the decode step (worth it for long outputs).
Bad input exits with status 2 and a message.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from atma_titan.data.tokenizer import decode_readable
from atma_titan.utils.device import resolve_device
from atma_titan.utils.errors import InputError
from atma_titan.checkpoint.open import load_eval_model, open_checkpoint
from atma_titan.inference import Generator, Request, Sampling, cast_for_inference
from atma_titan.utils.cli import add_checkpoint_arguments, command, command_parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = command_parser("generate", "Generate text from an ATMA checkpoint (paged KV cache, batched decoding).")
    add_checkpoint_arguments(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt; its continuation is streamed to stdout")
    source.add_argument("--prompts", help='a JSONL file, one {"prompt": "..."} per line')
    p.add_argument("--out", help="with --prompts: the JSONL file to write (default: stdout)")
    p.add_argument(
        "--show-ids",
        action="store_true",
        help='also print the generated token ids (EOT included): a line "ids: ..." after the text, or an "ids" '
        "list in each JSON line of --prompts",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt, at most")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass; 1 = all")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded at once")
    p.add_argument("--max-context", type=int, help="cache per sequence in tokens (default: longest prompt + new)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (a power of two)")
    p.add_argument("--no-cache", action="store_true", help="recompute the full forward for every token (slow)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the decode step eagerly on CUDA")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the decode step (about a minute per batch size; faster)"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda or cuda:N")
    return p.parse_args(argv)


def read_prompts(path: str) -> list[str]:
    """The prompts of a JSONL file: {"prompt": "..."} objects or bare strings, one per line."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"--prompts {path}: no such file")
    prompts = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not JSON ({e.msg})") from None
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise InputError(f'{path}:{number}: expected {{"prompt": "..."}} or a JSON string')
        prompts.append(text)
    if not prompts:
        raise InputError(f"--prompts {path} holds no prompt")
    return prompts


def check_arguments(args: argparse.Namespace) -> None:
    Sampling(args.temperature, args.top_k, args.top_p)  # raises on a bad value
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size)):
        if value < 1:
            raise InputError(f"{flag} {value} is invalid; allowed: an integer >= 1")
    if args.max_context is not None and args.max_context < 1:
        raise InputError(f"--max-context {args.max_context} is invalid; allowed: an integer >= 1")
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        raise InputError(f"--page-size {args.page_size} is invalid; allowed: a power of two")
    if args.out and not args.prompts:
        raise InputError("--out is for --prompts (a single --prompt streams to stdout)")


class TextStream:
    """Prints the text of a growing token list as it becomes final (a multi-byte character can span tokens).

    Ids without text (outside the tokenizer's vocabulary, bytes that are not UTF-8, control characters) print as
    <id>."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.tokens: list[int] = []
        self.shown = 0

    def add(self, token: int, final: bool = False) -> None:
        self.tokens.append(token)
        text = decode_readable(self.tokenizer, self.tokens, final=final)  # not final: a character's start waits
        if len(text) > self.shown:
            self.out.write(text[self.shown :])
            self.out.flush()
            self.shown = len(text)


def generate(args: argparse.Namespace) -> int:
    check_arguments(args)
    texts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    opened = open_checkpoint(args.checkpoint, args.step, args.config)
    tokenizer, eot = opened.tokenizer, opened.tokenizer.eot_id
    prompts = [[eot] + list(tokenizer.encode(text)) for text in texts]
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    max_context = args.max_context or longest
    if longest > max_context:
        raise InputError(
            f"the longest prompt ({longest - args.max_new_tokens:,} tokens) + --max-new-tokens {args.max_new_tokens} "
            f"needs {longest:,} tokens of cache; --max-context is {max_context:,}"
        )
    device = resolve_device(args.device, what="--device")
    began = time.perf_counter()
    model = load_eval_model(opened.model_args, opened.resolved, device)
    if device.type == "cuda":
        cast_for_inference(model, torch.bfloat16)
    print(
        f"loaded {opened.resolved.path} (step {opened.resolved.step}) on {device} in "
        f"{time.perf_counter() - began:.1f} s; {len(prompts)} prompt(s), tokenizer {tokenizer.name}",
        file=sys.stderr,
        flush=True,
    )
    engine = Generator(
        model, max_batch=min(args.batch_size, len(prompts)), max_context=max_context, page_size=args.page_size,
        eot_id=eot, sampling=Sampling(args.temperature, args.top_k, args.top_p), seed=args.seed,
        use_cache=not args.no_cache, cuda_graphs=not args.no_cuda_graphs, compile=args.compile,
    )  # fmt: skip
    requests = [Request(p, args.max_new_tokens, i) for i, p in enumerate(prompts)]
    if args.prompt is not None:
        return _stream_one(engine, requests[0], tokenizer, args.show_ids)
    return _write_all(engine, requests, texts, tokenizer, args.out, args.show_ids)


def _stream_one(engine: Generator, request: Request, tokenizer, show_ids: bool) -> int:
    stream, began, finish = TextStream(tokenizer), time.perf_counter(), None
    for event in engine.generate([request]):
        stream.add(event.token, final=event.finished is not None)
        finish = event.finished
    seconds = time.perf_counter() - began
    n = len(stream.tokens)
    print(flush=True)  # end the streamed line
    if show_ids:
        print("ids:", *stream.tokens, flush=True)
    print(f"[{n} tokens in {seconds:.2f} s, {n / seconds:.1f} tokens/s; finished: {finish}]", file=sys.stderr)
    return 0


def _write_all(
    engine: Generator, requests: list[Request], texts: list[str], tokenizer, out: str | None, show_ids: bool
) -> int:
    sink = open(out, "w", encoding="utf-8") if out else sys.stdout
    generated: dict[int, list[int]] = {r.index: [] for r in requests}
    started = {r.index: None for r in requests}
    began, done, total = time.perf_counter(), 0, 0
    try:
        for event in engine.generate(requests):
            started[event.index] = started[event.index] or time.perf_counter()
            generated[event.index].append(event.token)
            total += 1
            if event.finished is None:
                continue
            tokens = generated.pop(event.index)
            text_tokens = tokens[:-1] if event.finished == "eot" else tokens
            row = {
                "index": event.index,
                "prompt": texts[event.index],
                "text": decode_readable(tokenizer, text_tokens),
                "prompt_tokens": len(requests[event.index].prompt),
                "new_tokens": len(tokens),
                "finish": event.finished,
                "seconds": round(time.perf_counter() - started[event.index], 4),
            }
            if show_ids:
                row["ids"] = tokens
            sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            sink.flush()
            done += 1
            print(f"[{done}/{len(requests)}] prompt {event.index}: {len(tokens)} tokens", file=sys.stderr, flush=True)
    finally:
        if out:
            sink.close()
    seconds = time.perf_counter() - began
    where = f" to {out}" if out else ""
    print(
        f"generated {total:,} tokens for {len(requests)} prompts in {seconds:.1f} s ({total / seconds:.1f} tokens/s)"
        f"{where}",
        file=sys.stderr,
    )
    return 0


@command
def main(argv: list[str] | None = None) -> int:
    return generate(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
