"""The job configuration: one dataclass per TOML section, read from TOML and `--section.key value` flags.

    python -m atma_titan.config            print the reference of every key (docs/config.md)
"""

from atma_titan.config.job import (
    ConfigError,
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
    README_MARKERS,
    Training,
    help_text,
    load_config,
    load_toml,
    opt,
    parse_overrides,
    reference_markdown,
    to_toml,
    update_readme,
    validate,
)

__all__ = [name for name in dir() if not name.startswith("_")]
