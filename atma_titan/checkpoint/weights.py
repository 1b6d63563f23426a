"""Full weights in one .safetensors file: the export a run writes at its end (`checkpoint.export_safetensors`,
`<run>/model.safetensors`) and loading such a file into a model.

The format holds tensors only, so loading one runs no code. Under FSDP2 the export gathers the shards
(collective) and rank 0 writes; a load reads the whole file on every rank, which keeps its own shards.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from atma_titan.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from atma_titan.checkpoint.safe_unpickle import short_reason
from atma_titan.utils.atomic import write_file_atomic

__all__ = ["export_safetensors", "load_safetensors"]


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights, views): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        t = t.detach().cpu().contiguous()
        storage = t.untyped_storage().data_ptr()
        out[name] = t.clone() if storage in seen else t
        seen.add(storage)
    return out


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@torch.no_grad()
def export_safetensors(model: nn.Module, path: str | Path, *, dtype: torch.dtype | None = None) -> Path | None:
    """Write the full (unsharded) weights to one .safetensors file from rank 0, atomically and durably.

    Collective under FSDP2 (every rank takes part in gathering the shards); only rank 0 writes,
    and returns the path (other ranks get None). `dtype` casts floating-point tensors, e.g. to bf16.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not _is_rank0():
        return None
    if dtype is not None:
        full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = _unshared(full)
    write_file_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}), durable=True)
    return path


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | Path, *, strict: bool = True) -> None:
    """Load a .safetensors file of full weights into `model` (names as written by export_safetensors).

    Meant for one device; under FSDP2 every rank reads the whole file and keeps its shards. The
    format holds tensors only (no code); a damaged file or one for another model is a CheckpointError.
    """
    try:
        full = load_file(str(path))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} does not exist") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable .safetensors file: {short_reason(e)}") from None
    try:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=strict))
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path} does not fit the model (another config?): {short_reason(e)}") from None
