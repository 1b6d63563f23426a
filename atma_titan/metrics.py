"""Measuring and logging training metrics.

Three small pieces:

* throughput accounting: ``flops_per_token`` (model FLOPs per trained token),
  ``peak_flops`` (dense bf16 peak of the local GPU) and ``Throughput`` (tokens/s
  and MFU between two log steps);
* ``device_memory_gib``: peak memory of the local device (or process, on CPU);
* ``MetricsLogger``: writes one dict of scalars per log step to stdout,
  ``metrics.jsonl``, TensorBoard and/or Weights & Biases. Only rank 0 writes.

The logger has no knowledge of the config module; the trainer maps its
``metrics.*`` config keys onto the keyword arguments.

Metric keys the stdout line knows how to format (anything else is appended as
``key value``): ``loss``, ``grad_norm``, ``lr``, ``tokens_per_second``, ``mfu``
(a fraction, printed as a percentage) and ``memory_gib``; a mixture's ``tokens/<source>`` are shown
together as each source's share of the tokens seen (``mix web 70% code 30%``) and its
``documents/<source>`` only in the files.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from atma_titan.utils.atomic import write_text_atomic
from atma_titan.utils.errors import InputError, import_optional
from atma_titan.utils.redact import redact_config, redact_text
from atma_titan.run.folder import METRICS_NAME, read_metrics

__all__ = [
    "PEAK_BF16_FLOPS",
    "peak_flops",
    "peak_flops_for_name",
    "flops_per_token",
    "format_duration",
    "format_stdout",
    "Throughput",
    "device_memory_gib",
    "MetricsLogger",
]

# Dense (no 2:4 sparsity) bf16 tensor-core peak FLOP/s per GPU, from NVIDIA
# datasheets (which quote the sparse figure; these are half of it). Keys are
# matched against torch.cuda.get_device_name() as whole words, longest key
# first, so "H100 PCIe" wins over "H100" and "L4" never matches "L40S".
# GPUs without bf16 tensor cores (T4, V100) are deliberately absent: an
# unknown peak is better than a made-up MFU.
PEAK_BF16_FLOPS: dict[str, float] = {
    # Ampere
    "A100": 312e12,
    "A800": 312e12,
    "A10": 125e12,
    "A10G": 125e12,  # AWS variant of A10; NVIDIA publishes no separate figure
    "A40": 149.7e12,
    # Ada
    "L4": 121e12,
    "L40": 181e12,
    "L40S": 362e12,
    # Hopper. Bare "H100" is the SXM part ("NVIDIA H100 80GB HBM3").
    "H100": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H800": 989e12,
    "H200": 989e12,
    "GH200": 989e12,
    # Blackwell
    "B200": 2.25e15,
    "GB200": 2.5e15,
}

# Longest first so the most specific entry is tried first.
_PEAK_PATTERNS = [
    (re.compile(rf"(?<![a-z0-9]){re.escape(key.lower())}(?![a-z0-9])"), flops)
    for key, flops in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0]))
]


def peak_flops_for_name(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a CUDA device name, or None if unknown."""
    name = device_name.lower()
    for pattern, flops in _PEAK_PATTERNS:
        if pattern.search(name):
            return flops
    return None


def peak_flops(device: torch.device | str) -> float | None:
    """Dense bf16 peak FLOP/s of ``device``; None on CPU or an unknown GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def flops_per_token(
    num_params: int,
    num_attention_layers: int,
    num_heads: int,
    head_dim: int,
    seq_len: int,
) -> int:
    """Training FLOPs per token: ``6 * N + 12 * L_attn * H * dh * T``.

    ``6 * N`` counts the forward (2N) and backward (4N) matmuls of the weights;
    the second term counts the attention score and value matmuls, which grow
    with sequence length and have no weights. ``num_params`` must be the
    *non-embedding* parameter count: an embedding lookup does no matmul (the
    output projection, if untied, is a matmul and belongs in N). Pass only the
    softmax-attention layers as ``num_attention_layers``; linear/recurrent
    layers are covered by their weights in N.
    """
    return 6 * num_params + 12 * num_attention_layers * num_heads * head_dim * seq_len


class Throughput:
    """Tokens/s and MFU over the interval between two ``compute()`` calls.

    Feed it the tokens this device processed (``update``), then call
    ``compute()`` at a log step. Timing is host wall-clock; the log step
    normally synchronises the device anyway (``loss.item()``), so the interval
    covers the real work. Call ``reset()`` after warm-up/compilation to keep it
    out of the first reading.
    """

    def __init__(
        self,
        flops_per_token: int | None = None,
        peak_flops: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        self._tokens = 0
        self._start = self._clock()

    def update(self, num_tokens: int) -> None:
        self._tokens += int(num_tokens)

    def compute(self) -> dict[str, float | None]:
        """Return ``{"tokens_per_second", "mfu"}`` and start a new interval.

        ``mfu`` is a fraction in [0, 1], or None when the peak or the
        FLOPs/token is unknown.
        """
        now = self._clock()
        elapsed = now - self._start
        tps = self._tokens / elapsed if elapsed > 0 else 0.0
        mfu = None
        if self.peak_flops and self.flops_per_token:
            mfu = tps * self.flops_per_token / self.peak_flops
        self._tokens, self._start = 0, now
        return {"tokens_per_second": tps, "mfu": mfu}


def device_memory_gib(device: torch.device | str) -> float:
    """Peak memory in GiB: allocated CUDA memory, else the process's peak RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource  # POSIX only; imported here so the module loads elsewhere

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux but bytes on macOS.
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


# --------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------


def _scalar(value: Any) -> Any:
    """Turn tensors / numpy scalars into plain Python numbers."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):
        return value.item()
    return float(value)


def _json_value(value: Any) -> Any:
    # Strict JSON has no NaN/Infinity; a diverged loss must still be readable
    # by jq & co, and null already means "not measured".
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    return value


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_duration(seconds: float) -> str:
    """41 -> '41s', 185 -> '3m05s', 7980 -> '2h13m', 100000 -> '1d03h'."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_stdout(step: int, metrics: dict[str, Any], eta_s: float | None = None) -> str:
    """One compact human-readable line for a log step (with the time left, when given)."""
    parts = [f"step {step:>4d}"]
    known = {
        "loss": lambda v: f"loss {v:.4f}",
        "grad_norm": lambda v: f"grad_norm {v:.2f}",
        "lr": lambda v: f"lr {v:.1e}",
        "tokens_per_second": lambda v: f"tok/s {v:,.0f}",
    }
    for key, fmt in known.items():
        if metrics.get(key) is not None:
            parts.append(fmt(metrics[key]))
    mfu = metrics.get("mfu")
    parts.append("mfu unknown peak" if mfu is None else f"mfu {100 * mfu:.1f}%")
    if metrics.get("memory_gib") is not None:
        parts.append(f"mem {metrics['memory_gib']:.1f} GiB")
    shown = set(known) | {"mfu", "memory_gib"}
    # A mixture's per-source counts (tokens/<source>, documents/<source>): one "mix" field of token shares.
    per_source = {k: v for k, v in metrics.items() if k.startswith(("tokens/", "documents/")) and v is not None}
    tokens = {k.split("/", 1)[1]: v for k, v in per_source.items() if k.startswith("tokens/")}
    for key, value in metrics.items():
        if key not in shown and key not in per_source and value is not None:
            parts.append(f"{key} {_format_value(value)}")
    if tokens:
        total = max(1, sum(tokens.values()))
        parts.append("mix " + " ".join(f"{name} {100 * n / total:.0f}%" for name, n in tokens.items()))
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def _keep_through(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl without the rows after `step` (a resumed run re-logs those steps)."""
    kept = [row for row in read_metrics(path) if int(row.get("step", 0)) <= step]
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in kept))


class MetricsLogger:
    """Write per-step scalar metrics to every enabled sink (rank 0 only).

    Sinks: a stdout line, ``<dump_folder>/metrics.jsonl`` (one JSON object per
    ``log`` call, flushed immediately), TensorBoard event files under
    ``<dump_folder>/tb/`` and a wandb run whose files live under
    ``<dump_folder>/wandb/``. TensorBoard and wandb are imported only when
    enabled. On any rank other than 0 the logger is a no-op: it creates no
    folders, files, output or wandb run.

    ``resume_step``: the run continues after this step. The rows after it are
    dropped from an existing metrics.jsonl (they are logged again) and a
    ``{"event": "resume", "step": N}`` row is written, so no step appears twice;
    TensorBoard purges its events after it. None appends as is.
    """

    def __init__(
        self,
        *,
        dump_folder: str | Path,
        rank: int = 0,
        stdout: bool = True,
        jsonl: bool = True,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "atma_titan",
        wandb_entity: str | None = None,
        wandb_run_name: str | None = None,
        wandb_mode: str = "online",
        config: dict | None = None,
        resume_step: int | None = None,
    ) -> None:
        if wandb_mode not in ("online", "offline", "disabled"):
            raise ValueError(f"metrics.wandb_mode must be 'online', 'offline' or 'disabled', got {wandb_mode!r}")
        self.dump_folder = Path(dump_folder)
        self.rank = rank
        # The config goes to TensorBoard and wandb (a remote service): never a credential in a URL.
        config = None if config is None else redact_config(config)
        self.enabled = rank == 0
        self._stdout = stdout and self.enabled
        self._jsonl_file = None
        self._tb_writer = None
        self._wandb_run = None
        if not self.enabled:
            return

        if jsonl or tensorboard or wandb:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
        try:
            if jsonl:
                self._jsonl_file = self._open_jsonl(resume_step)
            if tensorboard:
                self._tb_writer = self._open_tensorboard(config, resume_step)
            if wandb:
                self._wandb_run = self._open_wandb(wandb_project, wandb_entity, wandb_run_name, wandb_mode, config)
        except BaseException:
            self.close()  # don't leak the sinks that did open
            raise

    def _open_jsonl(self, resume_step: int | None):
        path = self.dump_folder / METRICS_NAME
        resumed = resume_step is not None and path.is_file()
        if resumed:
            _keep_through(path, resume_step)
        f = open(path, "a", encoding="utf-8")  # append: a resumed run continues its own file
        if resumed:
            f.write(json.dumps({"event": "resume", "step": resume_step}) + "\n")
            f.flush()
        return f

    def _open_tensorboard(self, config: dict | None, resume_step: int | None):
        tensorboard = import_optional(
            "torch.utils.tensorboard", "tensorboard", "metrics.tensorboard = true", "tensorboard"
        )
        purge = None if resume_step is None else resume_step + 1  # events after the resumed step are stale
        writer = tensorboard.SummaryWriter(log_dir=str(self.dump_folder / "tb"), purge_step=purge)
        if config is not None:
            # Indented block so TensorBoard's markdown renders it verbatim.
            text = json.dumps(config, indent=2, default=str)
            writer.add_text("config", "    " + text.replace("\n", "\n    "))
        return writer

    def _open_wandb(self, project, entity, name, mode, config):
        wandb = import_optional("wandb", "wandb", "metrics.wandb = true")
        if mode != "online":
            # wandb.init(mode=...) only affects the run; wandb's own telemetry
            # reads the process-wide settings and (wandb 0.31) still phones home
            # from an "offline" run unless the global mode says offline too.
            wandb.setup(settings=wandb.Settings(mode=mode))
        # wandb records the command line in the run's metadata: show it a redacted one (a data URL's credentials)
        argv, sys.argv = sys.argv, [redact_text(a) for a in sys.argv]
        try:
            return wandb.init(
                project=project,
                entity=entity,
                name=name,
                mode=mode,
                dir=str(self.dump_folder),
                config=config,
            )
        except wandb.errors.UsageError as e:  # online without credentials
            raise InputError(
                f"metrics.wandb_mode = 'online' but wandb cannot log in ({e}): run `wandb login` (or set "
                "WANDB_API_KEY), or set metrics.wandb_mode = 'offline' to write the run under the dump folder"
            ) from None
        finally:
            sys.argv = argv

    def log(self, step: int, metrics: dict[str, float | None], eta_s: float | None = None) -> None:
        """Write ``metrics`` for ``step`` to every enabled sink (``eta_s``, the time left: stdout only)."""
        if not self.enabled:
            return
        metrics = {k: _scalar(v) for k, v in metrics.items()}
        if self._stdout:
            print(format_stdout(step, metrics, eta_s), flush=True)
        if self._jsonl_file is not None:
            record = {"step": step, **{k: _json_value(v) for k, v in metrics.items()}}
            self._jsonl_file.write(json.dumps(record) + "\n")
            self._jsonl_file.flush()
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb_writer is not None:
            for key, value in numeric.items():
                self._tb_writer.add_scalar(key, value, step)
            # Log steps are rare; flushing keeps the events file current if the job dies.
            self._tb_writer.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(numeric, step=step)

    def close(self) -> None:
        """Flush and finish every sink. Safe to call more than once."""
        if self._jsonl_file is not None:
            self._jsonl_file.close()
            self._jsonl_file = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
