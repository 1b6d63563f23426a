"""The export command: write a checkpoint as a Hugging Face folder (atma_titan.hf.export).

    python -m atma_titan.export --checkpoint PATH --out DIR [--dtype bf16|fp32] [--step N] [--config FILE]

PATH is any checkpoint the eval command takes (a DCP step directory, a checkpoint folder, a run
folder, an exported .safetensors, an exported Hugging Face folder); its run's config.toml gives the
model and the tokenizer. `transformers.AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`
then loads DIR (atma_titan installed). Bad input (no config, no weights, damaged files) exits 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

from atma_titan.utils.errors import InputError
from atma_titan.utils.known_warnings import silence_known_warnings

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m atma_titan.export", description="Export an ATMA checkpoint as a Hugging Face folder."
    )
    p.add_argument("--checkpoint", required=True, help="step dir, checkpoint folder, run folder, or .safetensors")
    p.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights dtype (default fp32)")
    p.add_argument("--step", type=int, help="checkpoint step to load from a folder (default: newest complete)")
    p.add_argument("--config", help="the run's config.toml (default: found next to the checkpoint)")
    return p.parse_args(argv)


def export(args: argparse.Namespace) -> str:
    from atma_titan.checkpoint.open import load_eval_model, open_checkpoint
    from atma_titan.hf.export import export_hf

    opened = open_checkpoint(args.checkpoint, args.step, args.config)
    model = load_eval_model(opened.model_args, opened.resolved, torch.device("cpu"))
    resolved = opened.resolved
    out = export_hf(model, args.out, opened.cfg, dtype=DTYPES[args.dtype], step=resolved.step, run_dir=resolved.run_dir)
    return str(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    silence_known_warnings()
    try:
        out = export(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
