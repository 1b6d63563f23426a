"""Read an exported Hugging Face folder back: its model args, its full weights; no transformers needed.

Used by `checkpoint.initial_load_hf` (training: every rank reads the full weights, FSDP2 keeps its
shards) and by eval/generate (`--checkpoint DIR`). The weights are `model.safetensors`, or the
shards `model.safetensors.index.json` lists; their keys are `model.<atma key>` (AtmaForCausalLM
holds the ATMA model as `model`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from atma_titan.utils.errors import InputError
from atma_titan.models import ModelArgs

__all__ = [
    "HF_CONFIG",
    "RUN_CONFIG",
    "check_same_model",
    "hf_step",
    "is_hf_folder",
    "load_hf_weights",
    "read_hf_model_args",
    "read_hf_state",
]

HF_CONFIG = "config.json"
RUN_CONFIG = "training_config.toml"  # the run's resolved config, beside config.json
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PREFIX = "model."
# Fields that change how the model is computed or trained, not what its weights mean: they may differ.
NOT_ARCHITECTURE = {"attention_impl", "memory_impl", "mlp_impl", "conv_impl", "loss_impl", "attention_block",
                    "memory_chunk", "distractor_weight", "distractor_keys"}  # fmt: skip


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is not a readable JSON file: {e}") from None


def is_hf_folder(path: str | Path) -> bool:
    """A directory whose config.json says model_type "atma"."""
    config = Path(path) / HF_CONFIG
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") == "atma"
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def hf_step(folder: str | Path) -> int | None:
    """The training step the folder was exported at (config.json's training_step), if it says."""
    step = _read_json(Path(folder) / HF_CONFIG).get("training_step")
    return step if isinstance(step, int) else None


def read_hf_model_args(folder: str | Path) -> ModelArgs:
    """The ModelArgs an exported folder's config.json holds; InputError naming the file when it is not one."""
    path = Path(folder) / HF_CONFIG
    if not path.is_file():
        raise InputError(f"{folder} is no exported Hugging Face folder: it has no {HF_CONFIG}")
    config = _read_json(path)
    if config.get("model_type") != "atma":
        raise InputError(f"{path}: model_type is {config.get('model_type')!r}, not 'atma' (an atma_titan export)")
    fields = dataclasses.fields(ModelArgs)
    missing = [f.name for f in fields if f.name not in config and f.default is dataclasses.MISSING]
    if missing:
        raise InputError(f"{path} lacks the model keys {', '.join(missing)}")
    values = {f.name: config[f.name] for f in fields if f.name in config}
    values["global_layers"] = tuple(values.get("global_layers") or ())
    return ModelArgs(**values)


def _weight_files(folder: Path) -> list[Path]:
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if (folder / INDEX).is_file():
        weight_map = _read_json(folder / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{folder / INDEX} has no weight_map")
        return [folder / name for name in sorted(set(weight_map.values()))]
    raise InputError(f"{folder} holds no weights: neither {WEIGHTS} nor {INDEX}")


def read_hf_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The full weights of an exported folder (every shard), under atma_titan's own names."""
    state = {}
    for path in _weight_files(Path(folder)):
        try:
            state.update(load_file(str(path)))
        except FileNotFoundError:
            raise InputError(f"{path} does not exist (listed in {INDEX})") from None
        except (SafetensorError, OSError, ValueError) as e:
            raise InputError(f"{path} is not a readable .safetensors file: {e}") from None
    return {k[len(PREFIX) :] if k.startswith(PREFIX) else k: v for k, v in state.items()}


def check_same_model(
    expected: ModelArgs, found: ModelArgs, folder: str | Path, what: str = "the job's [model]"
) -> None:
    """InputError naming every architecture field where `found` (the folder's) differs from `expected`."""
    diffs = [
        f"{f.name} {getattr(found, f.name)!r} (expected {getattr(expected, f.name)!r})"
        for f in dataclasses.fields(ModelArgs)
        if f.name not in NOT_ARCHITECTURE and getattr(found, f.name) != getattr(expected, f.name)
    ]
    if diffs:
        raise InputError(f"{Path(folder) / HF_CONFIG} describes another model than {what}: {'; '.join(diffs)}")


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str | Path) -> None:
    """Load an exported folder's full weights into `model` (plain or FSDP2: each rank keeps its shards).

    The folder's model args must be the model's (else InputError naming the fields), and every tensor
    must fit (else InputError naming the tensors)."""
    args = getattr(model, "args", None)
    if args is not None:
        check_same_model(args, read_hf_model_args(folder), folder)
    state = read_hf_state(folder)
    # an FSDP2 parameter is a DTensor: its .shape is the full one
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{n} {tuple(state[n].shape)} (model {expected[n]})" for n in expected
             if n in state and tuple(state[n].shape) != expected[n]]  # fmt: skip
    if missing or unexpected or wrong:
        parts = [f"missing {', '.join(missing)}" if missing else "", f"unexpected {', '.join(unexpected)}"
                 if unexpected else "", f"shapes differ: {', '.join(wrong)}" if wrong else ""]  # fmt: skip
        raise InputError(f"the weights in {folder} do not fit the model: {'; '.join(p for p in parts if p)}")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
