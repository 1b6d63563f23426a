"""LM head + soft-capped cross-entropy, forward + backward: time and peak memory of each implementation.

    python benchmarks/kernels/lm_head_loss.py               # GPU: 16 x 2048 tokens, d 1024, V 50,304, bf16
    python benchmarks/kernels/lm_head_loss.py --cpu         # tiny shapes on the CPU (a smoke run of this script)

Rows (each: the summed CE of the head's logits against random labels, and the gradients with respect
to the hidden states, the head weight and the bias; parameters and hidden states in bf16, as under
FSDP2 with param_dtype bf16):

- plain: the trainer's training.loss = "plain" with training.compile = true: the compiled SoftcapHead
  (fp32 logits, ATMA's algebraic cap c z / sqrt(z^2 + c^2)), then the compiled summed cross-entropy;
- plain eager: the same uncompiled;
- fused triton: atma_titan.models.loss through SoftcapHead(x, LossTargets) with the cross-entropy kernel
  (model.loss_impl = "auto" on a GPU, what the trainer runs), at each --chunk-mib (GPU only);
- fused eager / fused compiled: the same with model.loss_impl = "reference" (the chunk math in PyTorch),
  eager at each --chunk-mib; compiled at the first as training.compile = true runs it (the head compiled
  with fullgraph as apply_compile does, and the chunk math compiled with the same backend);
- liger / cut-cross-entropy, when importable (skipped with a note otherwise): their fused linear
  cross-entropy with their own cap, tanh (Gemma-style, c tanh(z / c)), which is not ATMA's; speed
  peers only, not drop-in replacements.

Times are medians of CUDA-synchronised wall times over --runs runs after warm-up runs (compilation);
peak memory is the most allocated during one run above what was allocated before it (inputs,
parameters). Ratios are plain / row: > 1 is faster or smaller than plain. One implementation failing
(out of memory, a missing kernel) is recorded in its row and the others still run. The JSON goes to
benchmarks/results/lm_head_loss-<tag>-<date>.json (tag: --tag, else the GPU's name, else "cpu").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.models.atma import SoftcapHead  # noqa: E402
from atma_titan.models.loss import LossTargets, chunk_tokens_for  # noqa: E402
from atma_titan.train import cross_entropy_sum  # noqa: E402
from benchmarks.common import device_name, result_path, write_json  # noqa: E402

GPU_SHAPE = dict(batch=16, seq=2048, d_model=1024, vocab=50_304)
CPU_SHAPE = dict(batch=2, seq=64, d_model=32, vocab=1000)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with tiny shapes (a smoke run)")
    parser.add_argument("--batch", type=int, help="sequences (default 16; --cpu: 2)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 2048; --cpu: 64)")
    parser.add_argument("--d-model", type=int, help="hidden size (default 1024; --cpu: 32)")
    parser.add_argument("--vocab", type=int, help="vocabulary (default 50,304; --cpu: 1000)")
    parser.add_argument("--cap", type=float, default=15.0, help="logit soft-cap c (ATMA's default 15)")
    parser.add_argument(
        "--chunk-mib", help="fused: fp32 logits per chunk in MiB, a list (default 1024,256,64; --cpu: 0.4,0.1,0.025)"
    )
    parser.add_argument("--runs", type=int, default=10, help="timed runs per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (compilation, autotuning)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: fast)")
    parser.add_argument("--tag", help="results file tag (default: the GPU's name, or cpu)")
    parser.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Problem:
    """bf16 hidden states and head, random labels: every row computes the loss of the same numbers."""

    def __init__(self, shape: dict, cap: float, device: torch.device):
        torch.manual_seed(0)
        b, t, d, v = shape["batch"], shape["seq"], shape["d_model"], shape["vocab"]
        self.device, self.cap = device, cap
        self.head = SoftcapHead(d, v, cap, loss_impl="reference").to(device=device, dtype=torch.bfloat16)
        self.kernel_head = SoftcapHead(d, v, cap, loss_impl="triton")  # the same parameters, the kernel's loss
        self.kernel_head.weight, self.kernel_head.bias = self.head.weight, self.head.bias
        with torch.no_grad():  # a trained head's logits reach the cap; the zero-initialised one's would not
            self.head.weight.normal_(0, 3 / d**0.5)
            self.head.bias.normal_(0, 1)
        self.hidden = torch.randn(b, t, d, device=device, dtype=torch.bfloat16).requires_grad_()
        self.labels = torch.randint(0, v, (b, t), device=device)
        self.leaves = [self.hidden, self.head.weight, self.head.bias]

    def clear_grads(self) -> None:
        for t in self.leaves:
            t.grad = None


def plain_rows(p: Problem, backend: str) -> dict[str, Callable[[], torch.Tensor]]:
    compiled_head = torch.compile(p.head, fullgraph=True, backend=backend)
    compiled_ce = torch.compile(cross_entropy_sum, backend=backend)
    return {
        "plain": lambda: compiled_ce(compiled_head(p.hidden), p.labels),
        "plain eager": lambda: cross_entropy_sum(p.head(p.hidden), p.labels),
    }


def fused_rows(p: Problem, backend: str, chunk_mibs: list[float], notes: dict) -> dict[str, Callable[[], torch.Tensor]]:
    rows = {}
    for mib in chunk_mibs:
        if p.device.type != "cuda":
            notes["fused triton"] = "skipped: a Triton kernel, GPU only"
            break
        targets = LossTargets(p.labels, chunk_mib=mib)
        rows[f"fused triton {mib:g} MiB"] = lambda targets=targets: p.kernel_head(p.hidden, targets)
    for mib in chunk_mibs:
        targets = LossTargets(p.labels, chunk_mib=mib)
        rows[f"fused eager {mib:g} MiB"] = lambda targets=targets: p.head(p.hidden, targets)
    compiled_head = torch.compile(p.head, fullgraph=True, backend=backend)
    targets = LossTargets(p.labels, chunk_mib=chunk_mibs[0], compile_backend=backend)
    rows[f"fused compiled {chunk_mibs[0]:g} MiB"] = lambda: compiled_head(p.hidden, targets)
    return rows


def peer_rows(p: Problem, notes: dict) -> dict[str, Callable[[], torch.Tensor]]:
    """Liger Kernel and cut-cross-entropy, with their own (tanh) cap, where installed and on a GPU."""
    rows = {}
    tanh = "tanh soft-cap c*tanh(z/c), not ATMA's algebraic c*z/sqrt(z^2+c^2): a speed peer only"
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as e:
        notes["liger"] = f"skipped: liger_kernel is not importable ({e})"
    else:
        notes["liger"] = f"liger_fused_linear_cross_entropy(bias, reduction='sum', softcap=c): {tanh}"
        rows["liger (tanh cap)"] = lambda: liger_fused_linear_cross_entropy(
            p.hidden.flatten(0, 1), p.head.weight, p.labels.flatten(), p.head.bias, reduction="sum", softcap=p.cap
        )
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError as e:
        notes["cut-cross-entropy"] = f"skipped: cut_cross_entropy is not importable ({e})"
    else:
        notes["cut-cross-entropy"] = f"linear_cross_entropy(bias, softcap=c, reduction='sum'), impl cce: {tanh}"
        rows["cut-cross-entropy (tanh cap)"] = lambda: linear_cross_entropy(
            p.hidden, p.head.weight, p.labels, bias=p.head.bias, softcap=p.cap, reduction="sum"
        )
    if p.device.type != "cuda" and rows:
        for name in rows:
            notes[name] = "skipped: a Triton kernel, GPU only"
        rows = {}
    return rows


def run_once(p: Problem, fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    p.clear_grads()
    synchronize(p.device)
    start = time.perf_counter()
    loss = fn()
    loss.backward()
    synchronize(p.device)
    return time.perf_counter() - start, loss.detach()


def peak_mib(p: Problem, fn: Callable[[], torch.Tensor]) -> float | None:
    if p.device.type != "cuda":
        return None
    p.clear_grads()
    synchronize(p.device)
    before = torch.cuda.memory_allocated(p.device)
    torch.cuda.reset_peak_memory_stats(p.device)
    fn().backward()
    synchronize(p.device)
    return (torch.cuda.max_memory_allocated(p.device) - before) / 2**20


def measure(p: Problem, name: str, fn: Callable[[], torch.Tensor], args, reference: dict | None) -> dict:
    row: dict = {"impl": name}
    try:
        for _ in range(args.warmup):
            run_once(p, fn)
        times, loss = [], None
        for _ in range(args.runs):
            seconds, loss = run_once(p, fn)
            times.append(seconds)
        grads = [t.grad.float().clone() for t in p.leaves]
        row.update(ms=1000 * statistics.median(times), peak_mib=peak_mib(p, fn), loss=loss.float().item())
        if reference is not None:  # how far from the plain row's numbers (bf16 matmuls, fp32 elsewhere)
            row["loss_rel_diff"] = abs(row["loss"] - reference["loss"]) / abs(reference["loss"])
            row["grad_rel_diff"] = [
                ((g - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, reference["grads"])
            ]
        else:
            row["grads"] = grads
    except Exception as e:  # noqa: BLE001 - one failing implementation must not cost the others their numbers
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        if p.device.type == "cuda":
            torch.cuda.empty_cache()
    finally:
        p.clear_grads()
    return row


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    shape = dict(CPU_SHAPE if device.type == "cpu" else GPU_SHAPE)
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    default_chunks = "0.4,0.1,0.025" if device.type == "cpu" else "1024,256,64"  # several chunks at either shape
    chunk_mibs = [float(m) for m in (args.chunk_mib or default_chunks).split(",")]
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as train.py
    p = Problem(shape, args.cap, device)
    tokens = shape["batch"] * shape["seq"]
    print(
        f"{tokens:,} tokens x d {shape['d_model']} x V {shape['vocab']:,}, bf16, cap {args.cap:g}, on {device}; "
        f"fused chunks: " + ", ".join(f"{m:g} MiB = {chunk_tokens_for(shape['vocab'], m)} tokens" for m in chunk_mibs),
        flush=True,
    )
    notes: dict = {}
    rows = {**plain_rows(p, args.compile_backend), **fused_rows(p, args.compile_backend, chunk_mibs, notes)}
    rows.update(peer_rows(p, notes))
    results, reference = [], None
    for name, fn in rows.items():
        ours = name.startswith(("plain", "fused"))  # the peers cap differently: their numbers differ by design
        row = measure(p, name, fn, args, reference if ours else None)
        if name == "plain" and "error" not in row:
            reference = {"loss": row["loss"], "grads": row.pop("grads")}
        row.pop("grads", None)
        results.append(row)
    base = results[0]
    for row in results:
        if "error" in row or "error" in base:
            print(f"{row['impl']:<30} {row.get('error', 'no plain baseline')}", flush=True)
            continue
        row["speedup_vs_plain"] = base["ms"] / row["ms"]
        if row["peak_mib"]:
            row["memory_ratio_vs_plain"] = base["peak_mib"] / row["peak_mib"]
        memory = f"{row['peak_mib']:9.0f} MiB ({row['memory_ratio_vs_plain']:5.2f}x)" if row["peak_mib"] else ""
        print(f"{row['impl']:<30} {row['ms']:9.2f} ms ({row['speedup_vs_plain']:5.2f}x) {memory}", flush=True)
    for name, note in notes.items():
        print(f"note: {name}: {note}")
    report = {
        "shape": {**shape, "tokens": tokens},
        "cap": args.cap,
        "dtype": "bfloat16",
        "device": device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "compile_backend": args.compile_backend,
        "runs": args.runs,
        "rows": results,
        "notes": notes,
    }
    write_json(result_path("lm_head_loss", args.out, device.type if device.type == "cpu" else None, args.tag), report)


if __name__ == "__main__":
    main()
