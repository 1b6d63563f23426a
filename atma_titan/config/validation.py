"""Cross-field and range checks of a resolved config, which the field types alone cannot express."""

from __future__ import annotations

from typing import Any

from atma_titan.config.sections import JobConfig
from atma_titan.data.build import RANDOM_ACCESS
from atma_titan.data.mixture import parse_mixture
from atma_titan.data.skips import skip_pairs
from atma_titan.models.flavors import resolve_model_args
from atma_titan.utils.errors import ConfigError


def check(ok: bool, key: str, value: Any, allowed: str, origin: str = "") -> None:
    """Raise a ConfigError naming the key, its value and what is allowed (and the file, where given) unless `ok`."""
    if not ok:
        raise ConfigError(f"{origin + ': ' if origin else ''}'{key}' = {value!r} is invalid; allowed: {allowed}.")


def validate(cfg: JobConfig, origin: str = "config") -> None:
    """Cross-field and range checks that the types alone cannot express (`origin`: the file the mixture came from)."""
    t = cfg.training
    need = check

    need(t.steps >= 1, "training.steps", t.steps, "an integer >= 1")
    need(t.seq_len >= 2, "training.seq_len", t.seq_len, "an integer >= 2")
    need(t.micro_batch_size >= 1, "training.micro_batch_size", t.micro_batch_size, "an integer >= 1")
    need(
        t.batch_tokens % t.seq_len == 0,
        "training.batch_tokens",
        t.batch_tokens,
        f"a multiple of training.seq_len ({t.seq_len})",
    )
    need(t.max_norm >= 0, "training.max_norm", t.max_norm, ">= 0")
    need(t.loss_chunk_mib > 0, "training.loss_chunk_mib", t.loss_chunk_mib, "a number > 0")
    need(t.gc_interval >= 0, "training.gc_interval", t.gc_interval, "an integer >= 0 (0 = automatic collection)")
    need(cfg.metrics.log_freq >= 1, "metrics.log_freq", cfg.metrics.log_freq, "an integer >= 1")
    need(cfg.data.num_workers >= 0, "data.num_workers", cfg.data.num_workers, "an integer >= 0")
    need(cfg.data.recall_weight > 0, "data.recall_weight", cfg.data.recall_weight, "a number > 0")
    need(
        cfg.data.recall_weight == 1.0 or cfg.data.source == "synthetic",
        "data.recall_weight",
        cfg.data.recall_weight,
        "1.0 unless data.source = synthetic (only the synthetic source plants recall records)",
    )
    need(
        0.0 <= cfg.lr_scheduler.decay_start <= 1.0,
        "lr_scheduler.decay_start",
        cfg.lr_scheduler.decay_start,
        "a fraction in [0, 1]",
    )
    need(
        0.0 <= cfg.lr_scheduler.min_lr_ratio <= 1.0,
        "lr_scheduler.min_lr_ratio",
        cfg.lr_scheduler.min_lr_ratio,
        "a fraction in [0, 1]",
    )
    validate_mixture(cfg, origin)
    skip_pairs(cfg.data.skip, "data.skip", 1)
    skip_pairs(cfg.data.skip_windows, "data.skip_windows", 0)
    need(
        not cfg.data.skip_windows or cfg.data.source in RANDOM_ACCESS or bool(cfg.data.sources),
        "data.skip_windows",
        cfg.data.skip_windows,
        "empty for a streamed text or HF source (it has no global window index: use data.skip, whole steps)",
    )
    need(cfg.lr_scheduler.warmup_steps >= 0, "lr_scheduler.warmup_steps", cfg.lr_scheduler.warmup_steps, ">= 0")
    need(
        len(cfg.optimizer.adam_betas) == 2 and all(0 <= b < 1 for b in cfg.optimizer.adam_betas),
        "optimizer.adam_betas",
        cfg.optimizer.adam_betas,
        "two numbers in [0, 1)",
    )
    need(cfg.checkpoint.interval >= 1, "checkpoint.interval", cfg.checkpoint.interval, "an integer >= 1")
    need(cfg.checkpoint.keep_latest_k >= 0, "checkpoint.keep_latest_k", cfg.checkpoint.keep_latest_k, ">= 0")
    need(
        not (cfg.checkpoint.initial_load_hf and cfg.checkpoint.load_path),
        "checkpoint.initial_load_hf",
        cfg.checkpoint.initial_load_hf,
        "empty when checkpoint.load_path is set (one starting point)",
    )
    need(
        cfg.activation_checkpoint.every_n >= 1,
        "activation_checkpoint.every_n",
        cfg.activation_checkpoint.every_n,
        "an integer >= 1",
    )
    need(cfg.eval.interval >= 0, "eval.interval", cfg.eval.interval, ">= 0 (0 = off)")
    need(cfg.eval.val_batches >= 0, "eval.val_batches", cfg.eval.val_batches, ">= 0")
    need(
        all(isinstance(g, int) and g >= 1 for g in cfg.eval.needle_gaps),
        "eval.needle_gaps",
        cfg.eval.needle_gaps,
        "a list of positive integers",
    )
    need(cfg.profiling.start_step >= 1, "profiling.start_step", cfg.profiling.start_step, "an integer >= 1")
    need(cfg.profiling.steps >= 1, "profiling.steps", cfg.profiling.steps, "an integer >= 1")
    validate_long_runs(cfg)
    resolve_model_args(cfg.model)  # the flavor and the overrides together (models/flavors.py)


def validate_long_runs(cfg: JobConfig) -> None:
    """The keys that guard a long run (spikes, the watchdog, the collective timeout) and the fault injectors."""
    need = check
    sp = cfg.spikes
    need(sp.window >= 1, "spikes.window", sp.window, "an integer >= 1")
    need(1 <= sp.warmup <= sp.window, "spikes.warmup", sp.warmup, f"an integer in [1, spikes.window = {sp.window}]")
    need(sp.loss_z > 0, "spikes.loss_z", sp.loss_z, "a number > 0")
    need(sp.grad_z > 0, "spikes.grad_z", sp.grad_z, "a number > 0")
    need(sp.records >= 0, "spikes.records", sp.records, "an integer >= 0")
    need(cfg.debug.nan_at_step >= 0, "debug.nan_at_step", cfg.debug.nan_at_step, ">= 0")
    need(cfg.debug.signal_at_step >= 0, "debug.signal_at_step", cfg.debug.signal_at_step, ">= 0")
    need(cfg.debug.memory_cap_gib >= 0, "debug.memory_cap_gib", cfg.debug.memory_cap_gib, ">= 0")
    need(cfg.debug.sleep_at_step >= 0, "debug.sleep_at_step", cfg.debug.sleep_at_step, ">= 0")
    need(cfg.debug.sleep_seconds >= 0, "debug.sleep_seconds", cfg.debug.sleep_seconds, ">= 0")
    need(cfg.parallelism.timeout_s >= 1, "parallelism.timeout_s", cfg.parallelism.timeout_s, "an integer >= 1")
    wd = cfg.watchdog
    need(wd.slow_factor == 0 or wd.slow_factor >= 1, "watchdog.slow_factor", wd.slow_factor, ">= 1, or 0 = off")
    need(wd.min_seconds >= 0, "watchdog.min_seconds", wd.min_seconds, ">= 0 (seconds)")


def validate_mixture(cfg: JobConfig, origin: str) -> None:
    """[[data.sources]] and [[data.stages]] and the keys that depend on them; errors name `origin`, the file."""

    def need(ok: bool, key: str, value: Any, allowed: str) -> None:
        check(ok, key, value, allowed, origin)

    mixture = parse_mixture(cfg.data, cfg.training.steps, origin)  # [[data.sources]] and [[data.stages]], or None
    need(
        mixture is None or cfg.data.recall_weight == 1.0,
        "data.recall_weight",
        cfg.data.recall_weight,
        "1.0 with [[data.sources]] (the recall weights are for one synthetic source)",
    )
    decay_stage = cfg.lr_scheduler.decay_stage
    need(
        not decay_stage or (mixture is not None and mixture.stage_named(decay_stage) is not None),
        "lr_scheduler.decay_stage",
        decay_stage,
        f"a stage of [[data.stages]] ({', '.join(s.name for s in mixture.stages) if mixture else 'none here'})",
    )
    need(
        not decay_stage or cfg.lr_scheduler.name == "constant_then_linear",
        "lr_scheduler.decay_stage",
        decay_stage,
        "empty unless lr_scheduler.name = 'constant_then_linear'",
    )


def config_warnings(cfg: JobConfig) -> list[str]:
    """What a valid config probably did not mean: one line each, naming the keys and their values."""
    found = []
    warmup, steps = cfg.lr_scheduler.warmup_steps, cfg.training.steps
    if warmup > steps:
        found.append(
            f"'lr_scheduler.warmup_steps' = {warmup} is longer than the run ('training.steps' = {steps}): the "
            f"learning rate reaches only {steps / warmup:.0%} of its peak; lower the warm-up or raise the steps"
        )
    return found
