"""The config's sections: one dataclass per TOML section, each field with its default, a one-line doc and
(for strings) its allowed values; JobConfig, which holds them all; and the TOML text of a config."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from atma_titan.models.flavors import FLAVORS, ModelArgs, config_fields
from atma_titan.models.loss import DEFAULT_CHUNK_MIB
from atma_titan.utils.redact import redact_config


def opt(default: Any, doc: str, choices: tuple | None = None):
    """A config field: its default, a one-line doc, and (for strings) the allowed values."""
    meta = {"doc": doc, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    dump_folder: str = opt("./outputs/debug", "Run folder: resolved config, metrics, checkpoints.")
    description: str = opt("", "Free-text description of the run.")
    seed: int = opt(0, "Seed for model initialisation and data order.")
    deterministic: bool = opt(False, "Use deterministic algorithms (slower; for debugging and tests).")
    dry_run: bool = opt(
        False, "Build the model on the meta device, print its size and per-rank memory plan (job.gpu), and exit."
    )
    print_config: bool = opt(False, "Print the resolved config at start (it is always written to config.toml).")
    gpu: str = opt(
        "auto",
        "The dry run's memory plan: the GPU to fit (auto: this machine's, else every one listed; all: every one).",
        ("auto", "all", "l4", "a100-40", "a100-80", "h100", "h200"),
    )
    plan_world_size: int = opt(
        0, "The dry run's memory plan: data-parallel ranks to plan for (0: torchrun's WORLD_SIZE, else 1)."
    )


def _model_section() -> type:
    """`[model]`: the flavor, then every ModelArgs config field as an optional override (None: the flavor's).

    Generated from atma_titan.models.flavors.ModelArgs, where each hyper-parameter, its doc and its
    allowed values are written once."""
    hints = typing.get_type_hints(ModelArgs)
    fields = [("flavor", str, opt("debug", "Named model size (atma_titan.models.flavors).", tuple(FLAVORS)))]
    for f in config_fields():
        kind = f.metadata["config_type"] or hints[f.name]
        doc = f"{f.metadata['doc']} (None: the flavor's)."
        fields.append((f.name, Optional[kind], opt(None, doc, f.metadata["choices"])))
    section = dataclasses.make_dataclass("Model", fields)
    section.__module__ = __name__
    return section


Model = _model_section()


@dataclass
class Training:
    steps: int = opt(100, "Optimizer steps to train.")
    seq_len: int = opt(2048, "Tokens per training sequence.")
    batch_tokens: int = opt(524_288, "Global batch in tokens per optimizer step (all ranks, all micro-batches).")
    micro_batch_size: int = opt(8, "Sequences per forward/backward on one rank; the rest is gradient accumulation.")
    max_norm: float = opt(1.0, "Gradient-norm clip, 0 = off.")
    mixed_precision: str = opt("bf16", "Autocast dtype on GPU (CPU always trains in fp32).", ("bf16", "fp32"))
    device: str = opt("auto", "Device: auto (CUDA if present), cpu or cuda.", ("auto", "cpu", "cuda"))
    compile: bool = opt(False, "torch.compile each block (fullgraph).")
    compile_backend: str = opt(
        "inductor", "torch.compile backend (aot_eager: fast to compile, for tests).", ("inductor", "aot_eager", "eager")
    )
    nan_policy: str = opt(
        "abort", "On a NaN/Inf loss or gradient: stop (last checkpoint intact) or skip the step.", ("abort", "skip")
    )
    loss: str = opt(
        "fused",
        "LM loss: fused (the head computes CE and its gradients chunk by chunk, never holding the tokens x vocab "
        "logits) or plain (fp32 logits, then cross-entropy).",
        ("fused", "plain"),
    )
    loss_chunk_mib: float = opt(
        DEFAULT_CHUNK_MIB, "loss = fused: fp32 logits per chunk of tokens, in MiB (larger chunks are faster)."
    )
    gc_interval: int = opt(
        50,
        "Python garbage collection: off during the loop, the young generations collected every N steps on every "
        "rank at once (atma_titan/run/gc_schedule.py); 0 = Python's automatic collection.",
    )


@dataclass
class ActivationCheckpoint:
    mode: str = opt(
        "none",
        "Recompute activations in backward: none, full blocks, or selective (op-level).",
        ("none", "full", "selective"),
    )
    every_n: int = opt(1, "With mode = full: checkpoint every N-th block.")
    selective_save: str = opt(
        "matmuls",
        "With mode = selective: the outputs kept besides the kernels': every matmul's (nothing is computed twice), "
        "narrow_matmuls (the MLP up-projection is recomputed: about half the memory) or kernels (every matmul "
        "is recomputed).",
        ("matmuls", "narrow_matmuls", "kernels"),
    )
    blocks: str = opt(
        "all",
        "The blocks checkpointed: all, global (the attention + memory blocks; the convolution blocks keep "
        "every activation: their two norms are not recomputed, for 128 MiB more per block and 32K-token "
        "micro-batch at 370M) or local (the convolution blocks).",
        ("all", "global", "local"),
    )


@dataclass
class Optimizer:
    name: str = opt(
        "muon_adamw", "Muon for block matrices + AdamW for the rest, or AdamW for all.", ("muon_adamw", "adamw")
    )
    muon_lr: float = opt(0.02, "Muon learning rate (every >=2-D weight inside the blocks).")
    muon_weight_decay: float = opt(0.01, "Muon decoupled weight decay.")
    muon_momentum: float = opt(0.95, "Muon momentum (Nesterov).")
    muon_ns_steps: int = opt(5, "Newton-Schulz iterations per Muon step.")
    adam_betas: list = opt([0.8, 0.95], "AdamW betas.")
    adam_eps: float = opt(1e-10, "AdamW epsilon.")
    adam_weight_decay: float = opt(0.0, "AdamW weight decay.")
    embed_lr: float = opt(0.3, "AdamW learning rate of the token embedding.")
    head_lr: float = opt(1 / 320, "AdamW learning rate of the LM head.")
    scalar_lr: float = opt(0.01, "AdamW learning rate of 1-D parameters (norms, biases, per-head scalars).")
    matrix_lr: float = opt(0.003, "AdamW learning rate of block matrices when name = adamw.")


@dataclass
class LRScheduler:
    name: str = opt("constant_then_linear", "Schedule shape.", ("constant_then_linear", "warmup_cosine"))
    decay_start: float = opt(0.3, "constant_then_linear: fraction of steps held constant before the linear decay.")
    warmup_steps: int = opt(0, "Linear warm-up steps (both schedules).")
    min_lr_ratio: float = opt(0.0, "Final learning rate as a fraction of the peak.")
    decay_stage: str = opt(
        "",
        "constant_then_linear: start the decay where this data stage ([[data.stages]] name) starts, not at "
        "decay_start.",
    )


@dataclass
class Data:
    source: str = opt(
        "synthetic",
        "Token source: built-in synthetic, llm.c .bin shards, text files, or a HF dataset.",
        ("synthetic", "bin", "text", "hf"),
    )
    path: str = opt("", "bin: glob or URL of train shards; text: glob of .txt/.jsonl/.parquet files; hf: hub id.")
    val_path: str = opt("", "Validation data, same kind as `path` (bin: the validation shard).")
    hf_config: str = opt("", "hf: dataset config name (e.g. sample-10BT).")
    hf_split: str = opt("train", "hf: split to stream.")
    text_field: str = opt("text", "jsonl / parquet / hf: the field that holds the document text.")
    tokenizer: str = opt("byte", "byte, gpt2 (tiktoken), or a tokenizer.json path / Hugging Face hub id.")
    seed: int = opt(1234, "Seed of the synthetic source, and of a mixture's draw of each window's source.")
    recall_weight: float = opt(
        1.0,
        "synthetic: training-loss weight of the planted recall tokens (1 = the plain LM loss). The filler "
        "language is easy to learn and its gradient drowns the copy signal of a tiny model; weighting the "
        "recall tokens lets induction form (the small-scale reproduction uses it).",
    )
    num_workers: int = opt(0, "Data-loader worker processes per rank.")
    document_mask: bool = opt(
        False,
        "Keep documents apart inside a training window: no mixer reads across a document start (the EOT before "
        "each document): attention sees only its own document's keys, the memory restarts from zero and the "
        "convolutions from zero history. Off: a window is a stretch of the token stream (docs/data.md).",
    )
    skip: list = opt(
        [],
        "Steps of the data stream to leave out, [[first, last], ...] (a rollback past a loss spike; may change on "
        "resume ahead of the position; docs/training.md, Long runs).",
    )
    skip_windows: list = opt(
        [], "Windows of the global stream to leave out, [[first, last], ...] (.bin, synthetic, mixtures)."
    )
    sources: list[dict] = opt(
        [],
        "A mixture, in the TOML file: [[data.sources]] tables of name, source, path, weight (and val_path, "
        "hf_config, hf_split, text_field, seed); they replace source/path/val_path (docs/data.md, Mixtures).",
    )
    stages: list[dict] = opt(
        [],
        "With sources, in the TOML file: [[data.stages]] tables of name, start_step (or start, a fraction of "
        "training.steps) and weights = {source = weight}, each the mixture from that step on.",
    )


@dataclass
class Spikes:
    policy: str = opt(
        "log",
        "What a loss or gradient-norm spike does: log it, skip the step (no update), or stop the run "
        "(docs/training.md, Long runs).",
        ("off", "log", "skip", "stop"),
    )
    window: int = opt(200, "Recent accepted steps whose median and spread a step's loss and grad norm are judged by.")
    warmup: int = opt(50, "Steps in the window before spikes are judged.")
    loss_z: float = opt(6.0, "A spike: a loss this many robust standard deviations above the window's median.")
    grad_z: float = opt(10.0, "A spike: a gradient norm this many robust standard deviations above the median.")
    records: int = opt(
        3, "Bad-batch records kept in <dump_folder>/bad_batches/ (non-finite or spiking steps; 0 = none)."
    )


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints (every `interval` steps, at the end, and on SIGTERM/SIGUSR1).")
    folder: str = opt("checkpoints", "Checkpoint folder, relative to job.dump_folder.")
    interval: int = opt(500, "Save every N steps (and at the end).")
    keep_latest_k: int = opt(0, "Keep only the newest K complete checkpoints (0 = keep all).")
    async_save: bool = opt(False, "Write checkpoints in the background while training continues.")
    resume: bool = opt(True, "Resume from the newest complete checkpoint in the folder, if there is one.")
    load_step: int = opt(
        -1,
        "Resume from this step instead of the newest (-1 = newest); the first time, newer checkpoints are moved "
        "to checkpoints/rolled_back/, and a rerun of the same command continues from the run's own newer ones.",
    )
    load_path: str = opt(
        "", "Start from this checkpoint directory (e.g. another run's step-N) when the folder has none."
    )
    model_only: bool = opt(False, "With load_path: load only the model weights (fine-tuning), not optimizer or step.")
    export_safetensors: bool = opt(
        False, "At the end, also write the final weights to <dump_folder>/model.safetensors."
    )
    export_hf: bool = opt(
        False, "At the end, also write a Hugging Face folder <dump_folder>/hf/ (transformers, trust_remote_code)."
    )
    initial_load_hf: str = opt(
        "", "Start from the weights of this exported Hugging Face folder when the run has no checkpoint of its own."
    )


@dataclass
class Parallelism:
    dp_shard: int = opt(-1, "FSDP shard degree, -1 = all ranks not used by other dimensions.")
    dp_replicate: int = opt(1, "Replicate degree (HSDP when > 1).")
    reshard_after_forward: Optional[bool] = opt(
        None,
        "FSDP: free the gathered block parameters after forward (less memory, one more all-gather per block in "
        "backward). Unset: true when blocks are sharded over several ranks, false at dp_shard = 1.",
    )
    timeout_s: int = opt(
        600,
        "Seconds a collective may wait for the other ranks before it fails (init_process_group's timeout; NCCL "
        "aborts the job then). Raise it when a rank legitimately works alone longer (a large export).",
    )


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log every N steps (and the first and last step).")
    stdout: bool = opt(True, "Print a line per logged step.")
    jsonl: bool = opt(True, "Append one JSON object per logged step to metrics.jsonl.")
    tensorboard: bool = opt(False, "Write TensorBoard scalars under <dump_folder>/tb.")
    wandb: bool = opt(False, "Log to Weights & Biases.")
    wandb_project: str = opt("atma_titan", "wandb project.")
    wandb_entity: Optional[str] = opt(None, "wandb entity (team or user).")
    wandb_run_name: Optional[str] = opt(None, "wandb run name (None: the dump folder's name).")
    wandb_mode: str = opt("online", "wandb mode.", ("online", "offline", "disabled"))


@dataclass
class Eval:
    interval: int = opt(0, "Validation loss and a short needle check every N steps and at the end (0 = off).")
    val_batches: int = opt(8, "Validation micro-batches per rank (held-out seed for synthetic, data.val_path for bin).")
    needle_gaps: list = opt([], "Gaps in tokens of the in-training needle check ([] = off; synthetic data only).")
    needle_trials: int = opt(8, "Probes per gap of the in-training needle check.")


@dataclass
class Profiling:
    enable: bool = opt(False, "Record a torch.profiler trace (CPU + CUDA) of a few steps on every rank.")
    start_step: int = opt(6, "First recorded step (leave the compilation and autotuning steps out).")
    steps: int = opt(2, "Number of recorded steps.")
    folder: str = opt("profile", "Trace folder, relative to job.dump_folder: Chrome traces and a top-kernels table.")


@dataclass
class Debug:
    nan_at_step: int = opt(0, "Fault injection: make the loss NaN at this step (0 = never).")
    signal_at_step: int = opt(0, "Fault injection: send SIGTERM to one rank during this step (0 = never).")
    signal_rank: int = opt(0, "Fault injection: the rank that gets the signal, or sleeps at sleep_at_step.")
    spike_at_step: int = opt(0, "Fault injection: multiply the loss by spike_factor at this step (0 = never).")
    spike_factor: float = opt(50.0, "Fault injection: the factor of spike_at_step.")
    memory_cap_gib: float = opt(
        0.0, "Cap this process's GPU memory at this many GiB, to try a smaller GPU's fit on a larger one (0 = no cap)."
    )
    sleep_at_step: int = opt(
        0, "Fault injection: rank signal_rank sleeps sleep_seconds inside this step, a straggler (0 = never)."
    )
    sleep_seconds: float = opt(0.0, "Fault injection: how long signal_rank sleeps at sleep_at_step.")


@dataclass
class Watchdog:
    slow_factor: float = opt(
        10.0,
        "A step that runs this many times the median of the recent steps (and longer than min_seconds) is a hang: "
        "every rank dumps its threads' stacks to <dump_folder>/hangs/ and exits with status 4 (0 = off).",
    )
    min_seconds: float = opt(
        600.0,
        "The watchdog never judges a step before it has run this long: above any slow but healthy step "
        "(the first after a resume or an evaluation, a profiler export).",
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    spikes: Spikes = field(default_factory=Spikes)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    parallelism: Parallelism = field(default_factory=Parallelism)
    metrics: Metrics = field(default_factory=Metrics)
    eval: Eval = field(default_factory=Eval)
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)
    watchdog: Watchdog = field(default_factory=Watchdog)

    def to_dict(self) -> dict:
        """The config as plain values, URLs redacted (atma_titan.utils.redact): it is what config.toml, the printed
        config and the metric sinks show, so no credential in a URL leaves the process. The job itself reads
        the real values from the dataclasses."""
        return redact_config(dataclasses.asdict(self))

    def to_toml(self) -> str:
        """config.toml's text, redacted like `to_dict`; the trainer recognises its own run folder by comparing
        it with the folder's config.toml, redacted text with redacted text."""
        return to_toml(self.to_dict())


SECTION_TYPES = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # TOML section -> its class


def field_types(section_cls: type) -> dict[str, Any]:
    """Each field's type, resolved from its annotation."""
    return typing.get_type_hints(section_cls)


def type_name(tp: Any) -> str:
    """A field type as the help and the error messages name it: int, float, str, bool, list, "int or none"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{type_name(inner[0])} or none"
    if origin is list or tp is list:
        return "list"
    return getattr(tp, "__name__", str(tp))


def to_toml(data: dict) -> str:
    """Serialise a two-level dict of plain values as TOML (None values are written as comments)."""
    lines = []
    for section, table in data.items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            lines.append(f"# {key} = none" if value is None else f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table: a mixture's [[data.sources]] are written as a list of them
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")
