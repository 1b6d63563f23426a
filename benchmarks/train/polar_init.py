"""Polar's global block at init and over a short AdamW run on the repro's recall task (issue 20).

Why it exists: the "polar, no memory" cell of the small-scale reproduction (docs/results.md, train_configs/repro/)
never learned recall. This probe found the cause: Polar's unit direction c reached the zero-initialised
W_o sqrt(head_dim) times smaller than the memory readout (model.polar_direction = "unit"); "rms", the
default now, feeds W_o with sqrt(head_dim) c. It measures, on a fixed probe batch of repro windows:

- at init: the attention mass on real keys against the null entry, by the number n of visible keys;
  the largest weight among the real keys; the RMS of W_o's input against the memory readout's
  (rms_norm(r), the input of the memory's projection); and the q/k/v_proj gradient norms with a probe
  W_o and head (both start at zero, which blocks every gradient to q/k/v);
- every --every training steps (plain AdamW, linear warm-up, gradients clipped to training.max_norm,
  the recall tokens weighted by data.recall_weight): the batch's weighted loss, the recall-token
  accuracy and CE on the probe batch, and the same attention and scale statistics. The initial
  weights come from the config's job.seed; nothing else is random.

One arm (the Polar scalar inits of atma_titan.models.attention.POLAR_INIT with --set, the config's
keys after --):

    python benchmarks/train/polar_init.py --config train_configs/repro/polar_nomemory.toml --json out.json \\
        [--set len_gain=-6] [-- --model.polar_direction unit]

The H200 table (benchmarks/results/polar_init-h200-2026-12-01/summary.md): the seven arms of ARMS, run at once as
subprocesses on one GPU (about 2 minutes), then the summary:

    python benchmarks/train/polar_init.py --arms all --device cuda --out benchmarks/results/polar_init-h200-<date>

Results go to the --out folder: <arm>.json and <arm>.log per arm (the logs are not kept), and summary.md
(each arm runs with ATMA_TRITON_AUTOTUNE=0 unless it is set: seven processes tuning at once mis-time).
`--summarize DIR` rewrites summary.md's table from DIR/*.json and keeps the text above its marker
line. On CPU, a smoke test: --device cpu --steps 2 --batch 2 --every 1 --probe-batch 2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository: atma_titan without an install

from atma_titan.config import load_config  # noqa: E402
from atma_titan.data import build_source  # noqa: E402
from atma_titan.utils.errors import InputError  # noqa: E402
from atma_titan.kernels.polar import polar_scalars  # noqa: E402
from atma_titan.models import build_model, resolve_model_args  # noqa: E402
from atma_titan.models import attention as attention_module  # noqa: E402
from atma_titan.models.attention import GlobalAttention  # noqa: E402
from atma_titan.train import clip_gradients, cross_entropy_sum  # noqa: E402

REPRO = "train_configs/repro"
PROBE_START = 10_000_000  # the probe batch's first window: far from every training window
MASS_AT_N = (1, 8, 32, 64, 128)
TABLE_STEPS = (100, 300, 600, 900, 1200, 1500)
SUMMARY_MARK = "<!-- table below: python benchmarks/train/polar_init.py --summarize DIR -->"
# Flags a run of --arms hands on to each arm's process.
SHARED_FLAGS = ("steps", "batch", "probe_batch", "lr", "warmup", "every", "device")


@dataclass(frozen=True)
class Arm:
    config: str  # a file of train_configs/repro/, without .toml
    inits: str = ""  # --set: Polar scalar inits
    overrides: tuple[str, ...] = ()  # config keys


ARMS = {
    "polar_nomemory-unit": Arm("polar_nomemory", overrides=("--model.polar_direction", "unit")),
    "polar_nomemory-rms": Arm("polar_nomemory", overrides=("--model.polar_direction", "rms")),
    # len_gain = -6: softplus(-6) ln(128) = 0.012, a length temperature of ~1 at init
    "polar_nomemory-unit-len_gain-6": Arm("polar_nomemory", "len_gain=-6", ("--model.polar_direction", "unit")),
    "polar_nomemory-rms-len_gain-6": Arm("polar_nomemory", "len_gain=-6", ("--model.polar_direction", "rms")),
    "polar_memory-unit": Arm("polar_memory", overrides=("--model.polar_direction", "unit")),
    "polar_memory-rms": Arm("polar_memory", overrides=("--model.polar_direction", "rms")),
    "softmax_nomemory": Arm("softmax_nomemory"),
}


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, T) inputs
    labels: torch.Tensor  # (B, T) next tokens
    weights: torch.Tensor  # (B, T) loss weight of each label: recall_weight at recall tokens, else 1
    recall: torch.Tensor  # (B, T) bool: the label is a recall token


# ----------------------------------------------------------------------------------------------
# Data and loss
# ----------------------------------------------------------------------------------------------


def recall_batch(source, start: int, size: int, seq_len: int, recall_weight: float, device) -> Batch:
    """Windows start .. start + size - 1 of the synthetic source, as next-token pairs with their recall mask."""
    tokens, recall = source.batch(range(start, start + size), seq_len + 1)
    tokens, recall = torch.from_numpy(tokens).to(device), torch.from_numpy(recall[:, 1:]).to(device)
    weights = torch.where(recall, recall_weight, 1.0).float()
    return Batch(tokens[:, :-1], tokens[:, 1:], weights, recall)


def weighted_loss(model, batch: Batch) -> torch.Tensor:
    """The repro's training loss: next-token CE with the recall tokens up-weighted, per label."""
    return cross_entropy_sum(model(batch.tokens), batch.labels, batch.weights) / batch.labels.numel()


@torch.no_grad()
def recall_scores(model, batch: Batch) -> dict:
    """Accuracy and CE of the recall tokens alone: the task the loss's other tokens can hide."""
    logits = model(batch.tokens)[batch.recall]
    labels = batch.labels[batch.recall]
    return {
        "recall_acc": (logits.argmax(-1) == labels).float().mean().item(),
        "recall_ce": F.cross_entropy(logits, labels).item(),
    }


# ----------------------------------------------------------------------------------------------
# The global block's statistics
# ----------------------------------------------------------------------------------------------


def global_block(model) -> GlobalAttention:
    """The first global mixer: the repro model has one, and it is the only block that attends."""
    return next(b.mixer for b in model.blocks.values() if isinstance(b.mixer, GlobalAttention))


def rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()


@torch.no_grad()
def block_inputs(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward, recording the global mixer's input x, W_o's input and the memory readout (if any)."""
    attn = global_block(model)
    seen = {}
    taps = {"x": attn, "w_o_input": attn.o_proj}
    if attn.memory is not None:
        taps["memory_readout"] = attn.memory.proj  # its input: rms_norm(r) * gate
    hooks = [m.register_forward_hook(lambda _m, i, _o, key=key: seen.update({key: i[0]})) for key, m in taps.items()]
    try:
        model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@torch.no_grad()
def attention_weights(attn: GlobalAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's weights on x, materialised as in docs/model.md section 3.3.

    Returns the real keys' weights (B, H, T, T), the null's weight (B, H, T) (zero for softmax, which
    has no null) and the number of visible keys at each query position (T,).
    """
    a = attn.args
    q, _, k, _, _ = attn.project(x)
    B, T, H, D = q.shape
    keys = k.float().repeat_interleave(H // a.n_kv_heads, dim=2).transpose(1, 2)
    scores = q.float().transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(D)
    i, j = torch.arange(T, device=x.device)[:, None], torch.arange(T, device=x.device)[None, :]
    visible = (j <= i) & (j > i - a.window) if a.window else j <= i
    counts = visible.sum(-1)
    if a.attention != "polar":
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        return weights, torch.zeros(B, H, T, device=x.device), counts
    params = (attn.len_gain, attn.null_base, attn.null_slope)
    temp, null = polar_scalars(counts.float(), *(p.float()[:, None] for p in params))  # (H, T)
    key_logits = (temp[..., None] * scores).masked_fill(~visible, float("-inf"))
    null_logit = (temp * null).expand(B, H, T)[..., None]
    weights = torch.cat([key_logits, null_logit], dim=-1).softmax(-1)
    return weights[..., :-1], weights[..., -1], counts


def attention_stats(attn: GlobalAttention, x: torch.Tensor) -> dict:
    """Does the null floor shut the real keys out, and how peaked is the attention among them?"""
    w_keys, w_null, counts = attention_weights(attn, x)
    real = 1.0 - w_null
    by_n = {str(n): real[..., counts == n].mean().item() for n in MASS_AT_N if (counts == n).any()}
    return {
        "real_mass_by_n": by_n,
        "real_mass_mean": real.mean().item(),
        "top_weight_among_real": (w_keys.max(-1).values / real).mean().item(),
    }


def scale_stats(seen: dict[str, torch.Tensor]) -> dict:
    """W_o's input against the memory readout: under Adam the smaller input's path learns slower."""
    stats = {"w_o_input_rms": rms(seen["w_o_input"])}
    if "memory_readout" in seen:
        stats["memory_readout_rms"] = rms(seen["memory_readout"])
    return stats


def block_stats(model, probe: Batch) -> dict:
    """Attention and scale statistics of the global block on the probe batch, at the model's current state."""
    seen = block_inputs(model, probe.tokens)
    return {"attention": attention_stats(global_block(model), seen["x"]), "scale": scale_stats(seen)}


def probe_gradients(model, probe: Batch) -> dict:
    """q/k/v_proj gradient norms on a copy whose W_o and head get PyTorch's default Linear init.

    Both start at zero, which blocks every gradient to q/k/v; with a probe W_o the norms show how
    strongly the first updates would reach the attention path (they scale with W_o's input).
    """
    probe_model = copy.deepcopy(model)
    attn = global_block(probe_model)
    torch.manual_seed(123)  # the same probe weights in every arm
    attn.o_proj.reset_parameters()
    torch.manual_seed(124)
    probe_model.head.reset_parameters()
    weighted_loss(probe_model, probe).backward()
    return {name: getattr(attn, name).weight.grad.norm().item() for name in ("q_proj", "k_proj", "v_proj")}


# ----------------------------------------------------------------------------------------------
# One arm
# ----------------------------------------------------------------------------------------------


def parse_inits(text: str) -> dict[str, float]:
    """--set "len_gain=-6,null_base=2" -> {"len_gain": -6.0, "null_base": 2.0}, names from POLAR_INIT."""
    inits = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in attention_module.POLAR_INIT:
            raise InputError(
                f"--set {item!r}: expected NAME=VALUE with NAME one of {list(attention_module.POLAR_INIT)}"
            )
        try:
            inits[name] = float(value)
        except ValueError:
            raise InputError(f"--set {item!r}: {value!r} is not a number") from None
    return inits


def build_probed_model(args, seed: int, inits: dict[str, float], device):
    """The config's model with its initial weights, the Polar scalars started at `inits` instead of POLAR_INIT."""
    with mock.patch.dict(attention_module.POLAR_INIT, inits):  # read when the scalars are initialised
        return build_model(args, device, seed=seed)


def train(model, source, probe: Batch, opts, seq_len: int, recall_weight: float, max_norm: float) -> list[dict]:
    """Plain AdamW with a linear warm-up; a row of statistics every opts.every steps and at the last."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: min(1.0, (done + 1) / max(opts.warmup, 1)))
    rows, start = [], time.time()
    for step in range(1, opts.steps + 1):
        batch = recall_batch(source, (step - 1) * opts.batch, opts.batch, seq_len, recall_weight, probe.tokens.device)
        loss = weighted_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        grad_norm = clip_gradients(model, max_norm)
        optimizer.step()
        warmup.step()
        if step % opts.every == 0 or step == opts.steps:
            row = {"step": step, "loss": loss.item(), "grad_norm": grad_norm.item(), **recall_scores(model, probe)}
            row.update(block_stats(model, probe), sec=round(time.time() - start, 1))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def run_arm(opts) -> dict:
    """Build the arm's model, measure it at init, train it; the report that --json writes."""
    cfg = load_config(["--config", opts.config, *opts.overrides])
    if cfg.data.source != "synthetic":
        raise InputError(
            f"{opts.config}: data.source = {cfg.data.source!r}; the probe needs 'synthetic' (recall masks)"
        )
    args = resolve_model_args(cfg.model)
    inits = parse_inits(opts.set)
    device = torch.device(opts.device)
    model = build_probed_model(args, cfg.job.seed, inits, device)
    source = build_source(cfg.data, args.vocab_size)
    seq_len, recall_weight = cfg.training.seq_len, cfg.data.recall_weight
    probe = recall_batch(source, PROBE_START, opts.probe_batch, seq_len, recall_weight, device)
    report = {
        "config": opts.config,
        "overrides": opts.overrides,
        "polar_inits": inits,
        "model": {"attention": args.attention, "memory": args.memory, "polar_direction": args.polar_direction},
        "settings": {name: getattr(opts, name) for name in SHARED_FLAGS}
        | {"max_norm": cfg.training.max_norm, "torch": torch.__version__},
        "init": block_stats(model, probe) | {"grad_norm_with_probe_w_o": probe_gradients(model, probe)},
    }
    print(json.dumps(report["init"]), flush=True)
    report["train"] = train(model, source, probe, opts, seq_len, recall_weight, cfg.training.max_norm)
    return report


# ----------------------------------------------------------------------------------------------
# Several arms, and the summary
# ----------------------------------------------------------------------------------------------


def arm_command(name: str, opts, out: Path) -> list[str]:
    """The command line of one arm's process, with this run's shared flags."""
    arm = ARMS[name]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--config", f"{REPRO}/{arm.config}.toml"]
    cmd += ["--json", str(out / f"{name}.json"), "--set", arm.inits]
    for flag in SHARED_FLAGS:
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(opts, flag))]
    return [*cmd, "--", *arm.overrides]


def run_arms(names: list[str], opts, out: Path) -> list[str]:
    """Run the arms as concurrent processes (each holds its own model and POLAR_INIT); the names that failed."""
    out.mkdir(parents=True, exist_ok=True)
    # untimed kernel configs: seven processes autotuning at once on one GPU would time each other
    env = {**os.environ, "ATMA_TRITON_AUTOTUNE": os.environ.get("ATMA_TRITON_AUTOTUNE", "0")}
    with contextlib.ExitStack() as logs:
        procs = {}
        for name in names:
            log = logs.enter_context(open(out / f"{name}.log", "w"))
            procs[name] = subprocess.Popen(
                arm_command(name, opts, out), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        return [name for name, proc in procs.items() if proc.wait() != 0]


def load_runs(folder: Path) -> dict[str, dict]:
    """folder/*.json by file name, in ARMS order, then any other names sorted."""
    order = {name: i for i, name in enumerate(ARMS)}
    paths = sorted(folder.glob("*.json"), key=lambda p: (order.get(p.stem, len(order)), p.stem))
    return {p.stem: json.loads(p.read_text()) for p in paths}


def summary_table(runs: dict[str, dict], steps=TABLE_STEPS) -> str:
    """Markdown: a row per run, its recall-token accuracy in % (weighted training loss) at each step."""
    lines = ["| arm | " + " | ".join(f"step {s}" for s in steps) + " |", "| --- |" + " --- |" * len(steps)]
    for name, report in runs.items():
        rows = {row["step"]: row for row in report.get("train", [])}
        cells = [f"{100 * rows[s]['recall_acc']:.1f} ({rows[s]['loss']:.2f})" if s in rows else "-" for s in steps]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_summary(folder: Path, steps=TABLE_STEPS) -> str:
    """(Re)write folder/summary.md's table from folder/*.json; the text above SUMMARY_MARK is kept.

    A summary.md without the marker is all notes: the marker and the table go after it.
    """
    path = folder / "summary.md"
    old = path.read_text() if path.exists() else f"# Polar init probe: {folder.name}\n\n"
    head = old.split(SUMMARY_MARK)[0] if SUMMARY_MARK in old else old.rstrip("\n") + "\n\n"
    caption = "Recall-token accuracy % on the fixed probe batch (the training batch's weighted loss):\n\n"
    table = summary_table(load_runs(folder), steps)
    path.write_text(f"{head}{SUMMARY_MARK}\n\n{caption}{table}")
    return table


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options before `--`; the config keys (e.g. --model.polar_direction unit) after it."""
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--config", help="one arm: its TOML config (with --json)")
    mode.add_argument("--arms", help=f"'all' or a comma list of {', '.join(ARMS)}: run them at once (with --out)")
    mode.add_argument("--summarize", type=Path, metavar="DIR", help="rewrite DIR/summary.md from DIR/*.json")
    ap.add_argument("--json", type=Path, help="one arm: where its report goes")
    ap.add_argument("--out", type=Path, help="--arms: the results folder, benchmarks/results/polar_init-<gpu>-<date>")
    ap.add_argument("--set", default="", help="Polar scalar inits, e.g. len_gain=-6,null_base=2 (POLAR_INIT's names)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64, help="training sequences per step")
    ap.add_argument("--probe-batch", type=int, default=32, help="sequences in the fixed probe batch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100, help="steps of linear warm-up")
    ap.add_argument("--every", type=int, default=100, help="steps between rows of statistics")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--table-steps", default=",".join(map(str, TABLE_STEPS)), help="the summary table's columns")
    opts = ap.parse_args(argv)
    opts.overrides = overrides
    if opts.config and not opts.json:
        ap.error("--config needs --json (where the report goes)")
    if opts.arms and not opts.out:
        ap.error("--arms needs --out (the results folder)")
    if min(opts.steps, opts.batch, opts.probe_batch, opts.every) < 1:
        ap.error("--steps, --batch, --probe-batch and --every must be >= 1")
    return opts


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 an arm failed (its .log says why), 2 bad input."""
    opts = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        steps = [int(s) for s in opts.table_steps.split(",")]
    except ValueError:
        print(f"error: --table-steps {opts.table_steps!r}: expected comma-separated step numbers", file=sys.stderr)
        return 2
    if opts.summarize:
        print(write_summary(opts.summarize, steps))
        return 0
    if opts.arms:
        names = list(ARMS) if opts.arms == "all" else opts.arms.split(",")
        unknown = sorted(set(names) - set(ARMS))
        if unknown:
            print(f"error: --arms: unknown {unknown}; the arms are {list(ARMS)}", file=sys.stderr)
            return 2
        failed = run_arms(names, opts, opts.out)
        print(write_summary(opts.out, steps))
        if failed:
            print(f"failed: {failed} (see their .log in {opts.out})", file=sys.stderr)
        return 1 if failed else 0
    try:
        report = run_arm(opts)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
