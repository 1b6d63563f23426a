"""`sweep plan`: the estimated GPU-hours of a sweep's training, per cell and in total, per GPU kind.

A cell's run trains `training.steps * training.batch_tokens` tokens. Its tokens/s on a GPU kind is
the throughput table's tokens/s for that kind, scaled by FLOPs per token (atma_titan.metrics.
flops_per_token) from the table's reference model to the cell's model and sequence length, i.e.
the estimate assumes every cell reaches the reference's MFU. GPU-hours = tokens / (tokens/s per
GPU) / 3600: the same on one GPU or spread over eight (data parallelism taken as linear). Only
training is counted (evaluation and start-up are not).

The throughput table (BUILTIN_THROUGHPUT, or a JSON file of the same shape given by --throughput)::

    {"reference": {"flavor": "atma_370m", "seq_len": 2048}      (or {"flops_per_token": N, "label": ...}),
     "gpus": {"H200": {"tokens_per_s": 218729, "basis": "measured: ..."},
              "L4": {"scale_from": "H200"}}}                     (scaled by the bf16 dense peaks)

An entry with "scale_from" has no measurement: its tokens/s is that kind's times the ratio of the
two kinds' dense bf16 peaks (atma_titan.metrics.PEAK_BF16_FLOPS), and the output says "estimate".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from atma_titan.sweep.plan import Plan, SweepError, validate_cell

# Measured on one H200 (benchmarks/results/train_speed-h200-2026-12-03.json, docs/performance.md): the 370M
# at 2K, compile + Triton kernels, bf16, FSDP2 on one rank, the recipe's batch (524,288 tokens a step in 16
# micro-batches, selective AC in the global blocks), the setting a sweep cell of train_configs/atma_370m.toml
# trains with, so the one used here; and one micro-batch of 16 x 2,048 per step, for comparison.
H200_RECIPE_TOKENS_PER_S = 218_729
H200_ONE_MICRO_BATCH_TOKENS_PER_S = 192_700
H200_MEASUREMENT = "benchmarks/results/train_speed-h200-2026-12-03.json"
BUILTIN_THROUGHPUT = {
    "reference": {"flavor": "atma_370m", "seq_len": 2048},
    "gpus": {
        "H100": {"scale_from": "H200"},
        "H200": {
            "tokens_per_s": H200_RECIPE_TOKENS_PER_S,
            "basis": "measured: atma_370m at 2K on one H200, recipe batch with selective AC, compile + Triton "
            f"({H200_ONE_MICRO_BATCH_TOKENS_PER_S:,} at one micro-batch per step: {H200_MEASUREMENT})",
        },
        "L4": {"scale_from": "H200"},
    },
}
# A cell whose model needs less than this fraction of the reference's FLOPs per token runs far
# below the reference's MFU (launch- and memory-bound): its hours are marked as a lower bound.
SMALL_MODEL_FRACTION = 0.1


@dataclass(frozen=True)
class GpuThroughput:
    kind: str
    tokens_per_s: float  # of the reference model, per GPU
    basis: str  # "measured: ..." or "estimate: ..."
    measured: bool


@dataclass(frozen=True)
class ThroughputTable:
    reference_flops: float  # FLOPs per token of the reference model at its sequence length
    reference_label: str
    gpus: list[GpuThroughput]

    def tokens_per_s(self, gpu: GpuThroughput, flops_per_token: float) -> float:
        """This GPU kind's tokens/s for a model of `flops_per_token`, at the reference's MFU."""
        return gpu.tokens_per_s * self.reference_flops / flops_per_token


@dataclass(frozen=True)
class CellBudget:
    name: str
    runs: int  # seeds (1 without --seeds)
    tokens: int  # per run: training.steps * training.batch_tokens
    flops_per_token: float
    hours: dict[str, float]  # GPU kind -> GPU-hours of all the cell's runs
    small: bool  # far smaller than the reference: hours are a lower bound


# ---------------------------------------------------------------------------------------------
# The table


def model_flops_per_token(model_args, seq_len: int) -> int:
    """Training FLOPs per token of a model (the trainer's MFU formula: non-embedding weights, and
    the score / value matmuls of every global block at `seq_len`)."""
    import torch

    from atma_titan.metrics import flops_per_token
    from atma_titan.models.atma import ATMA, non_embedding_params

    with torch.device("meta"):  # the parameter count without memory or initialisation
        model = ATMA(model_args)
    n_global = sum(model_args.is_global(i) for i in range(model_args.n_layers))
    return flops_per_token(non_embedding_params(model), n_global, model_args.n_heads, model_args.head_dim, seq_len)


def _reference(spec: dict, where: str) -> tuple[float, str]:
    if "flops_per_token" in spec:
        flops = float(spec["flops_per_token"])
        return flops, str(spec.get("label", f"{flops:.3g} FLOP/token"))
    from atma_titan.models.flavors import FLAVORS

    flavor, seq_len = spec.get("flavor"), spec.get("seq_len")
    if flavor not in FLAVORS or not isinstance(seq_len, int) or seq_len < 1:
        raise SweepError(
            f"{where}: 'reference' needs a known 'flavor' ({', '.join(FLAVORS)}) and an integer 'seq_len' >= 1, "
            f"or 'flops_per_token'; got {json.dumps(spec)}."
        )
    return float(model_flops_per_token(FLAVORS[flavor], seq_len)), f"{flavor} at {seq_len:,} tokens"


def parse_throughput(data: dict, where: str = "the built-in throughput table") -> ThroughputTable:
    from atma_titan.metrics import PEAK_BF16_FLOPS

    try:
        reference, gpus = data["reference"], data["gpus"]
        if not isinstance(gpus, dict) or not gpus:
            raise TypeError("'gpus' must be a non-empty object")
    except (KeyError, TypeError) as e:
        raise SweepError(f"{where}: expected {{'reference': ..., 'gpus': {{KIND: ...}}}} ({e}).") from None
    reference_flops, label = _reference(reference, where)
    measured = {}
    for kind, entry in gpus.items():
        if "scale_from" not in entry:
            tps = entry.get("tokens_per_s")
            if not isinstance(tps, (int, float)) or tps <= 0:
                raise SweepError(f"{where}: gpus.{kind} needs 'tokens_per_s' > 0 or 'scale_from': KIND.")
            measured[kind] = GpuThroughput(kind, float(tps), str(entry.get("basis", "measured")), True)
    out = []
    for kind, entry in gpus.items():
        if kind in measured:
            out.append(measured[kind])
            continue
        source = entry["scale_from"]
        if source not in measured:
            known = ", ".join(measured) or "none"
            raise SweepError(f"{where}: gpus.{kind}.scale_from {source!r} is not a measured kind ({known}).")
        peaks = [PEAK_BF16_FLOPS.get(k) for k in (kind, source)]
        if None in peaks:
            raise SweepError(
                f"{where}: gpus.{kind}: no bf16 peak known for {kind if peaks[0] is None else source} "
                f"(known: {', '.join(PEAK_BF16_FLOPS)}); give its 'tokens_per_s' instead."
            )
        ratio = peaks[0] / peaks[1]
        basis = (
            f"estimate, not measured: {source} x {peaks[0] / 1e12:g}/{peaks[1] / 1e12:g} "
            "(dense bf16 peak TFLOP/s, same MFU assumed)"
        )
        out.append(GpuThroughput(kind, measured[source].tokens_per_s * ratio, basis, False))
    return ThroughputTable(reference_flops, label, out)


def read_throughput(path: str | None) -> ThroughputTable:
    if path is None:
        return parse_throughput(BUILTIN_THROUGHPUT)
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise SweepError(f"--throughput {path}: cannot read it ({e.strerror or e}).") from None
    except ValueError as e:
        raise SweepError(f"--throughput {path}: not JSON ({e}).") from None
    if not isinstance(data, dict):
        raise SweepError(f"--throughput {path}: expected a JSON object with 'reference' and 'gpus'.")
    return parse_throughput(data, f"--throughput {path}")


# ---------------------------------------------------------------------------------------------
# The estimate


def estimate(cells: list[tuple[str, int, int, float]], table: ThroughputTable) -> list[CellBudget]:
    """(name, runs, tokens per run, FLOPs per token) per cell -> its GPU-hours per GPU kind."""
    out = []
    for name, runs, tokens, flops in cells:
        hours = {g.kind: runs * tokens / table.tokens_per_s(g, flops) / 3600 for g in table.gpus}
        out.append(CellBudget(name, runs, tokens, flops, hours, flops < SMALL_MODEL_FRACTION * table.reference_flops))
    return out


def plan_cells(plan: Plan) -> list[tuple[str, int, int, float]]:
    """Each factor combination of the plan: (name, runs, tokens per run, FLOPs per token), from
    its config as the trainer would load it."""
    from atma_titan.models.flavors import resolve_model_args

    flops_cache: dict[tuple, int] = {}
    out = []
    for name, runs in plan.groups.items():
        cfg = validate_cell(plan.base, plan.fixed + list(runs[0].config_overrides))
        args = resolve_model_args(cfg.model)
        key = (repr(args), cfg.training.seq_len)
        if key not in flops_cache:
            flops_cache[key] = model_flops_per_token(args, cfg.training.seq_len)
        out.append((name, len(runs), cfg.training.steps * cfg.training.batch_tokens, float(flops_cache[key])))
    return out


def _tokens(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _hours(h: float) -> str:
    """GPU-hours with the digits that matter: 1,234.5 / 4.50 / 0.0021."""
    return f"{h:,.1f}" if h >= 100 else f"{h:.2f}" if h >= 0.01 or h == 0 else f"{h:.2g}"


def budget_report(plan: Plan, out: str, budgets: list[CellBudget], table: ThroughputTable) -> str:
    kinds = [g.kind for g in table.gpus]
    lines = [
        f"GPU-hour estimate for sweep {out}: {plan.describe_runs()}, training only.",
        f"Throughput per GPU of the reference ({table.reference_label}, "
        f"{table.reference_flops / 1e9:.3f} GFLOP/token):",
    ]
    lines += [f"  {g.kind:<6} {g.tokens_per_s:>10,.0f} tokens/s  {g.basis}" for g in table.gpus]
    header = ["#", "cell", "runs", "tokens/run", "GFLOP/token", *(f"{k} GPU-h" for k in kinds)]
    rows = [
        [str(i), b.name + (" *" if b.small else ""), str(b.runs), _tokens(b.tokens), f"{b.flops_per_token / 1e9:.4f}"]
        + [_hours(b.hours[k]) for k in kinds]
        for i, b in enumerate(budgets)
    ]
    total_tokens = sum(b.runs * b.tokens for b in budgets)
    runs = sum(b.runs for b in budgets)
    rows.append(
        ["", "total", str(runs), f"{_tokens(total_tokens)} in all", ""]
        + [_hours(sum(b.hours[k] for b in budgets)) for k in kinds]
    )
    width = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines.append("")
    for r in [header, *rows]:
        lines.append("  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width))))
    lines += [
        "",
        "GPU-h: GPU-hours for all of a cell's runs (on N GPUs the wall time is about GPU-h / N). Each cell's "
        "tokens/s is the reference's scaled by FLOPs per token, i.e. at the reference's MFU.",
    ]
    if any(b.small for b in budgets):
        lines.append(
            f"* under {SMALL_MODEL_FRACTION:.0%} of the reference's FLOPs per token: a small model runs far below "
            "its MFU, so these hours are a lower bound."
        )
    return "\n".join(lines)
