"""Timing shared by the one-pass backward benchmarks (mlp_backward.py, conv_backward.py, mlp_ac_memory.py): a
module compiled as training runs it, medians of CUDA-event timings, modules with autograd's and a hand-written
backward side by side, a sweep of a fixed-config kernel's tiles against its compiled PyTorch reference, and the
result file; and the options of the benchmarks of one part of the model at a micro-batch (global_projections.py,
final_norm.py). Needs a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from atma_titan.config import load_config
from atma_titan.models.flavors import ModelArgs, resolve_model_args
from atma_titan.parallel.parallelize import selective_policy

REPEATS = 20


def micro_batch_benchmark(doc: str, script: str) -> tuple[argparse.Namespace, ModelArgs]:
    """The command line of a benchmark of one part of the model at a micro-batch (--config, --tokens,
    --repeats, --out, its module doc as help) and the config's model hyper-parameters; exits without a
    GPU. The result goes through write_result."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/atma_370m.toml")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch (16 x 2,048)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    return args, resolve_model_args(load_config(["--config", args.config]).model)


def as_training_runs(module: nn.Module) -> nn.Module:
    """`module` under the recipe's selective AC, compiled with fullgraph=True, as the trainer wraps a block."""
    context = functools.partial(create_selective_checkpoint_contexts, selective_policy())
    return torch.compile(checkpoint_wrapper(module, context_fn=context), fullgraph=True)


def median_ms(fn: Callable[[], object], repeats: int = REPEATS, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compare_backwards(
    label: str, modules: list[tuple[str, nn.Module]], step: Callable[[nn.Module], object]
) -> list[dict]:
    """Time `step(compiled)` (one forward and backward) for each (name, module), compiled as training runs it,
    in bf16 on the GPU with the first module's weights (the first: autograd's backward). Print and return a
    row per module, its name under `label`, with its speed-up over the first."""
    base = modules[0][1].cuda().bfloat16()
    rows = []
    for name, module in modules:
        module = module.cuda().bfloat16()
        module.load_state_dict(base.state_dict())
        compiled = as_training_runs(module)
        rows.append({label: name, "forward_backward_ms": median_ms(lambda: step(compiled))})
    for row in rows:
        row["vs_autograd"] = rows[0]["forward_backward_ms"] / row["forward_backward_ms"]
        print(f"{row[label]:32s} {row['forward_backward_ms']:8.3f} ms  {row['vs_autograd']:.3f}x")
    return rows


def write_result(out: Path, stem: str, result: dict) -> Path:
    """Write `result` after the GPU's name and torch's version to out/<stem>-<gpu>.json (e.g. mlp_backward-h200)."""
    gpu = torch.cuda.get_device_name()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{gpu.split()[-1].lower()}.json"
    path.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, **result}, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def sweep_tiles(
    kernel: ModuleType,
    configs: list[tuple[int, int, int, int]],
    run: Callable[[int], object],
    reference_ms: float,
    moved: int,
) -> list[dict]:
    """Time `run(rows_per_program)` with the kernel module's tile constants (BLOCK_M, BLOCK_N, NUM_WARPS) set to
    its own config first, then to each of `configs` (block_m, block_n, warps, rows_per_program); restore them;
    print and return a row per config beside the reference's, with its bandwidth over `moved` bytes."""
    default = (kernel.BLOCK_M, kernel.BLOCK_N, kernel.NUM_WARPS, kernel.ROWS_PER_PROGRAM)
    rows = [{"kernel": "compiled PyTorch reference", "ms": reference_ms}]
    try:
        for block_m, block_n, warps, rows_per_program in [default, *configs]:
            kernel.BLOCK_M, kernel.BLOCK_N, kernel.NUM_WARPS = block_m, block_n, warps
            ms = median_ms(lambda: run(rows_per_program))
            rows.append({"kernel": f"Triton {block_m}x{block_n}, {warps} warps, {rows_per_program} rows", "ms": ms})
    finally:
        kernel.BLOCK_M, kernel.BLOCK_N, kernel.NUM_WARPS = default[:3]
    for row in rows:
        row["tb_per_s"] = moved / row["ms"] / 1e9
        row["vs_reference"] = reference_ms / row["ms"]
        print(f"{row['kernel']:48s} {row['ms']:7.3f} ms  {row['tb_per_s']:.2f} TB/s  {row['vs_reference']:.2f}x")
    return rows
