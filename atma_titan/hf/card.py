"""The README.md model card of an exported folder: how to load it, how to tokenize, what the run was."""

from __future__ import annotations

from pathlib import Path

import torch

from atma_titan.config import JobConfig
from atma_titan.hf.tokenizer import TokenizerExport
from atma_titan.models import ModelArgs
from atma_titan.run.folder import METRICS_NAME, read_metrics

__all__ = ["model_card", "training_summary"]


def training_summary(cfg: JobConfig, step: int | None, run_dir: str | Path | None) -> list[str]:
    """Steps, tokens seen and the last train / validation losses logged in the run's metrics.jsonl."""
    rows = []
    if run_dir is not None and (Path(run_dir) / METRICS_NAME).is_file():
        rows = [r for r in read_metrics(Path(run_dir) / METRICS_NAME) if "step" in r]
    if step is None and rows:
        step = max(r["step"] for r in rows)
    lines = []
    if step is not None:
        lines.append(f"- steps trained: {step:,} of {cfg.training.steps:,}")
        lines.append(f"- tokens seen: {step * cfg.training.batch_tokens:,} ({cfg.training.batch_tokens:,} per step)")
    for key, label in (("loss", "final train loss"), ("val_loss", "final validation loss")):
        logged = [r for r in rows if key in r and (step is None or r["step"] <= step)]
        if logged:
            lines.append(f"- {label}: {logged[-1][key]:.4f} (step {logged[-1]['step']:,})")
    return lines or ["- no training record found (no metrics.jsonl beside the checkpoint)"]


def _tokenizer_section(tokenizer: TokenizerExport) -> str:
    name = tokenizer.name
    if tokenizer.backend is not None:
        return (
            f"The run's tokenizer ({name!r}) is in this folder (tokenizer.json; the same ids as atma_titan's): "
            "`AutoTokenizer.from_pretrained(folder, trust_remote_code=True)` loads it (without the flag transformers "
            "asks whether to run the folder's model code), and lm-eval's `hf` model takes the folder as it is "
            "(`lm_eval run --model hf --model_args pretrained=folder,trust_remote_code=True`). Its end-of-text "
            f"token {tokenizer.eot_token!r} (id {tokenizer.eot_id}) separates documents and ends generation.\n"
        )
    return (
        f"**This folder has no tokenizer files, so `AutoTokenizer` cannot load the model's tokenizer** "
        f"(when it was written: {tokenizer.missing}). Export again where tokenizer {name!r} builds "
        "(`python -m atma_titan.export --checkpoint RUN --out folder`) to add them, or tokenize with atma_titan:\n\n"
        "```python\n"
        "from atma_titan.data.tokenizer import build_tokenizer\n"
        f"tokenizer = build_tokenizer({name!r})\n"
        'ids = torch.tensor([tokenizer.encode("Once upon a time")])\n'
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=32, do_sample=False)[0].tolist()))\n"
        "```\n"
    )


def model_card(
    cfg: JobConfig,
    args: ModelArgs,
    tokenizer: TokenizerExport,
    *,
    step: int | None = None,
    run_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    n_global = sum(args.is_global(i) for i in range(args.n_layers))
    weights = str(dtype or torch.float32).replace("torch.", "")
    return "\n".join(
        [
            f"# ATMA {cfg.model.flavor} model, trained with atma_titan",
            "",
            f"{args.n_layers} blocks ({n_global} global: {args.attention} attention"
            f"{' + gated-delta memory' if args.memory else ''}), d_model {args.d_model}, vocabulary "
            f"{args.vocab_size}; weights in {weights}.",
            "",
            "## Loading",
            "",
            "The code files here are thin shims: the model is defined in atma_titan, which must be installed "
            "(`pip install 'atma_titan[hf]'`).",
            "",
            "```python",
            "import torch",
            "from transformers import AutoModelForCausalLM",
            'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder", trust_remote_code=True)',
            "```",
            "",
            "In atma_titan: `python -m atma_titan.eval --checkpoint path/to/this/folder`, `python -m "
            "atma_titan.generate --checkpoint path/to/this/folder`, or start a run from it with "
            "`--checkpoint.initial_load_hf path/to/this/folder`.",
            "",
            "## Tokenizer",
            "",
            _tokenizer_section(tokenizer),
            "## Training",
            "",
            *training_summary(cfg, step, run_dir),
            "",
            f"The run's resolved config (also in {'training_config.toml'}):",
            "",
            "```toml",
            cfg.to_toml().rstrip(),
            "```",
            "",
        ]
    )
