"""The job configuration: one dataclass per TOML section, read from TOML and `--section.key value` flags.

Resolution order: dataclass defaults < the TOML file < `--section.key value` flags. Every field carries a
one-line doc in `field(metadata={"doc": ...})`; `--help` prints them all.

    sections    the dataclasses, JobConfig and its TOML text
    parse       TOML and command-line values coerced into a JobConfig (load_config)
    validation  cross-field and range checks (validate)
    reference   `--help`'s text and the markdown reference of docs/config.md

    python -m atma_titan.config                           print the reference of every key
    python -m atma_titan.config --update docs/config.md   rewrite docs/config.md's reference
"""

from atma_titan.config.parse import load_config, load_toml, parse_overrides
from atma_titan.config.reference import REFERENCE_MARKERS, help_text, reference_markdown, write_reference
from atma_titan.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Data,
    Debug,
    Eval,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    opt,
    to_toml,
)
from atma_titan.config.validation import validate
from atma_titan.utils.errors import ConfigError

__all__ = [name for name in dir() if not name.startswith("_")]
