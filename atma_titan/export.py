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

from atma_titan.utils.cli import add_checkpoint_arguments, command, command_parser

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = command_parser("export", "Export an ATMA checkpoint as a Hugging Face folder.")
    add_checkpoint_arguments(p)
    p.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the weights' dtype")
    return p.parse_args(argv)


def export(args: argparse.Namespace) -> str:
    from atma_titan.checkpoint.open import load_eval_model, open_checkpoint
    from atma_titan.hf.export import export_hf

    opened = open_checkpoint(args.checkpoint, args.step, args.config, with_tokenizer=False)  # export_hf builds it
    model = load_eval_model(opened.model_args, opened.resolved, torch.device("cpu"))
    resolved = opened.resolved
    out = export_hf(model, args.out, opened.cfg, dtype=DTYPES[args.dtype], step=resolved.step, run_dir=resolved.run_dir)
    return str(out)


@command
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = export(args)
    print(f"exported {args.checkpoint} to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
