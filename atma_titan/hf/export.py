"""Write a trained model as a Hugging Face folder that transformers loads with trust_remote_code=True.

    config.json                 every ModelArgs field, model_type "atma", auto_map to the two shims
    configuration_atma.py       shims: import AtmaConfig / AtmaForCausalLM from atma_titan (one model
    modeling_atma.py            definition, not a copy; atma_titan must be installed)
    model.safetensors           the weights (sharded with model.safetensors.index.json above MAX_SHARD)
    generation_config.json      eos = the tokenizer's end-of-text id
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
                                the run's tokenizer for AutoTokenizer (hf/tokenizer.py), when it builds here
    training_config.toml        the run's resolved config (eval and generate read it)
    README.md                   the model card: the config, tokens seen, final losses, how to tokenize

Collective under FSDP2 (every rank gathers the full weights); rank 0 writes. A tokenizer that cannot be
built here (gpt2 offline) does not stop the export: it is one warning line saying how to add it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from atma_titan.config import JobConfig
from atma_titan.utils.atomic import write_dir_atomic
from atma_titan.utils.errors import import_optional
from atma_titan.hf.card import model_card
from atma_titan.hf.load import PREFIX, RUN_CONFIG
from atma_titan.hf.tokenizer import TokenizerExport, prepare_tokenizer
from atma_titan.models import ModelArgs

__all__ = ["MAX_SHARD", "export_hf"]

MAX_SHARD = "2GB"
SHIMS = {
    "configuration_atma.py": ("atma_titan.hf.configuration", "AtmaConfig"),
    "modeling_atma.py": ("atma_titan.hf.modeling", "AtmaForCausalLM"),
}
AUTO_MAP = {"AutoConfig": "configuration_atma.AtmaConfig", "AutoModelForCausalLM": "modeling_atma.AtmaForCausalLM"}


def _shim(module: str, name: str) -> str:
    return (
        f'"""{name} for transformers (trust_remote_code=True): the model is defined once, in atma_titan.\n\n'
        "atma_titan must be installed: pip install 'atma_titan[hf]'.\n"
        '"""\n\n'
        f"from {module} import {name}\n\n"
        f'__all__ = ["{name}"]\n'
    )


def _is_main() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or (
        torch.distributed.get_rank() == 0
    )


@torch.no_grad()
def export_hf(
    model: nn.Module,
    out: str | Path,
    cfg: JobConfig,
    *,
    args: ModelArgs | None = None,
    dtype: torch.dtype | None = None,
    step: int | None = None,
    run_dir: str | Path | None = None,
    max_shard_size: str | int = MAX_SHARD,
) -> Path | None:
    """Write `model` (an ATMA, plain or FSDP2) with the run config `cfg` to the folder `out`.

    `dtype` casts the floating-point weights (e.g. bf16); `step` and `run_dir` (its metrics.jsonl)
    go into the model card. Returns the folder on rank 0, None on the other ranks.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not _is_main():
        return None
    transformers = import_optional("transformers", "hf", "the Hugging Face export")
    from atma_titan.hf.configuration import AtmaConfig
    from atma_titan.hf.modeling import AtmaForCausalLM

    args = args or model.args
    tokenizer = prepare_tokenizer(cfg.data.tokenizer)
    config = AtmaConfig.from_model_args(args, auto_map=AUTO_MAP, eos_token_id=tokenizer.eot_id, training_step=step)
    with torch.device("meta"):
        hf_model = AtmaForCausalLM(config)
    weights = {PREFIX + k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in full.items()}
    hf_model.load_state_dict(weights, assign=True)
    hf_model.generation_config = transformers.GenerationConfig(
        eos_token_id=tokenizer.eot_id, pad_token_id=tokenizer.eot_id
    )

    def fill(folder: Path) -> None:
        _save_model(transformers, hf_model, folder, max_shard_size)
        for file, (module, name) in SHIMS.items():
            (folder / file).write_text(_shim(module, name))
        tokenizer.write(folder)
        (folder / RUN_CONFIG).write_text(cfg.to_toml())
        (folder / "README.md").write_text(model_card(cfg, args, tokenizer, step=step, run_dir=run_dir, dtype=dtype))

    out = Path(out)
    write_dir_atomic(out, fill, durable=True)  # a previous export is replaced whole: no stale shards
    if tokenizer.backend is None:
        print(_no_tokenizer_warning(tokenizer, out, step, run_dir, dtype), file=sys.stderr, flush=True)
    return out


def _no_tokenizer_warning(tokenizer: TokenizerExport, out: Path, step, run_dir, dtype) -> str:
    again = f"python -m atma_titan.export --checkpoint {run_dir or out} --out {out}"
    again += (f" --step {step}" if step is not None else "") + (" --dtype bf16" if dtype == torch.bfloat16 else "")
    return (
        f"warning: no tokenizer files in {out} (AutoTokenizer and lm-eval's hf model need them): "
        f"{tokenizer.missing}; to add them, run `{again}` where tokenizer {tokenizer.name!r} builds"
    )


def _save_model(transformers, hf_model, folder: Path, max_shard_size: str | int) -> None:
    """save_pretrained's weights, config.json (with our auto_map) and generation_config.json, with no progress bar."""
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar in a training log
    try:
        hf_model.save_pretrained(folder, max_shard_size=max_shard_size)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    config_json = json.loads((folder / "config.json").read_text())
    config_json["auto_map"] = AUTO_MAP  # whatever save_pretrained made of it
    (folder / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
