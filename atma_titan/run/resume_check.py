"""What may change when a run resumes, and the refusal of everything else.

A resumed run continues the saved run: its checkpoints hold weights of one model, optimizer state of
one optimizer, and a position in one data stream. A key that changes any of these (the model, the
tokenizer, the data, the sequence length, the batch, the seeds, the optimizer's hyper-parameters,
which the loaded optimizer state would silently override) cannot change on resume: the trainer
refuses before it writes anything into the folder. The keys below may change; each change is printed.
docs/training.md lists them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from atma_titan.config import JobConfig, load_toml
from atma_titan.models.flavors import resolve_model_args
from atma_titan.utils.errors import InputError

ALL = "*"
# Section -> the keys that may change on resume (ALL: every key of the section).
RESUMABLE: dict[str, set[str] | str] = {
    "job": {"dump_folder", "description", "deterministic", "dry_run", "print_config", "gpu", "plan_world_size"},
    # Which kernel computes an op, not what it computes.
    "model": {"attention_impl", "memory_impl", "mlp_impl", "conv_impl", "loss_impl"},
    # The length of the run (the schedule follows it from the next step), how a step is computed, and
    # the clip, which no saved state overrides.
    "training": {
        "steps", "micro_batch_size", "max_norm", "mixed_precision", "device", "compile", "compile_backend",
        "nan_policy", "loss", "loss_chunk_mib", "gc_interval",
    },  # fmt: skip
    "activation_checkpoint": ALL,
    "lr_scheduler": ALL,  # a function of the step, recomputed at resume: a new schedule applies from the next step
    "data": {"num_workers", "val_path", "skip", "skip_windows"},  # skips: checked against the checkpoint's
    "checkpoint": ALL,
    "parallelism": ALL,  # checkpoints reshard to any world size
    "metrics": ALL,
    "spikes": ALL,  # how a step is judged, not what it computes
    "eval": ALL,
    "profiling": ALL,
    "debug": ALL,
    "watchdog": ALL,  # when a step counts as hung, not what it computes
}


@dataclasses.dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    requested: Any

    def describe(self) -> str:
        return f"{self.key} saved {self.saved!r}, requested {self.requested!r}"


def may_change(section: str, key: str) -> bool:
    allowed = RESUMABLE.get(section, set())
    return allowed == ALL or key in allowed


def config_changes(saved: JobConfig, requested: JobConfig) -> list[Change]:
    """Every key whose value differs between two configs, compared as config.toml shows them (URLs
    redacted); the model is compared as resolved from its flavor, so a key set to its flavor's value is no
    change."""
    changes = []
    old_config, new_config = saved.to_dict(), requested.to_dict()
    for section in sorted(old_config.keys() - {"model"}):
        old, new = old_config[section], new_config[section]
        changes += [Change(f"{section}.{key}", old[key], new[key]) for key in sorted(old) if old[key] != new[key]]
    old_model, new_model = (dataclasses.asdict(resolve_model_args(c.model)) for c in (saved, requested))
    changes += [
        Change(f"model.{key}", old_model[key], new_model[key]) for key in old_model if old_model[key] != new_model[key]
    ]
    return changes


def check_resume(saved_config: Path, requested: JobConfig) -> list[Change]:
    """The allowed changes from the run's saved config.toml; InputError naming every other change."""
    saved = JobConfig()
    load_toml(saved, saved_config)  # a file it cannot read, or a key it does not know: a ConfigError naming it
    changes = config_changes(saved, requested)
    refused = [c for c in changes if not may_change(*c.key.split(".", 1))]
    if refused:
        folder = saved_config.parent
        raise InputError(
            f"cannot resume {folder}: its checkpoints were trained with other values of "
            f"{'; '.join(c.describe() for c in refused)}. Put {'this key' if len(refused) == 1 else 'these keys'} "
            "back to resume this run, or choose another job.dump_folder to start a new one "
            f'(checkpoint.load_path = "{folder}" starts it from this run\'s weights where the model is the same). '
            "The keys that may change on resume are listed in docs/training.md"
        )
    return changes
