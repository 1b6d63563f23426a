"""The one-pass backward kernels against what they replace, on one GPU: the MLP's GLU backward
(atma_titan.kernels.glu) and the LFM2 conv block's backward (atma_titan.kernels.short_conv).

    python benchmarks/kernels/fused_backward.py [glu,conv] [--flavor atma_370m] [--batch 16] [--seq-len 2048]
                                                [--out benchmarks/results/]

For each op, two measurements in one process, the same weights throughout:

- the module's forward and backward as training runs it (compiled with fullgraph=True under the recipe's
  selective AC): with autograd's backward of the plain formula (`proj(glu(fc(x)))`,
  `out_proj(c * conv(b * x))`), with the hand-written backward around the compiled PyTorch reference, and
  around the Triton kernel;
- the backward kernel alone against its compiled PyTorch reference, at its own tile config and a few others
  (bandwidth over the bytes the kernel must move).

Times are medians of 20 CUDA-event timings after 3 warm-ups. Writes glu_backward-<gpu>-<date>.json and
conv_backward-<gpu>-<date>.json. Needs a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository: atma_titan and benchmarks.common without an install

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: E402
from torch.utils.checkpoint import create_selective_checkpoint_contexts  # noqa: E402

from atma_titan.kernels.glu import glu, glu_backward_reference  # noqa: E402
from atma_titan.kernels.short_conv import gated_conv_backward_reference  # noqa: E402
from atma_titan.models.conv import GatedShortConv  # noqa: E402
from atma_titan.models.flavors import FLAVORS  # noqa: E402
from atma_titan.models.layers import MLP  # noqa: E402
from atma_titan.parallel.parallelize import selective_policy  # noqa: E402
from benchmarks.common import REPEATS, device_name, median_ms, result_path, write_json  # noqa: E402


class AutogradMLP(MLP):
    """The MLP before the hand-written backward: autograd differentiates proj(glu(fc(x)))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(glu(self.fc(x), self.kind))


class AutogradGatedShortConv(GatedShortConv):
    """The mixer before the hand-written backward: autograd differentiates out_proj(c * conv(b * x))."""

    def forward(self, h: torch.Tensor, cache=None):
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        return self.out_proj(c * self.conv(b * x)), None


def as_training_runs(module: nn.Module) -> nn.Module:
    """`module` under the recipe's selective AC, compiled with fullgraph=True, as the trainer wraps a block."""
    context = functools.partial(create_selective_checkpoint_contexts, selective_policy())
    return torch.compile(checkpoint_wrapper(module, context_fn=context), fullgraph=True)


def compare_backwards(
    label: str, modules: list[tuple[str, nn.Module]], step: Callable[[nn.Module], object]
) -> list[dict]:
    """Time `step(compiled)` (one forward and backward) for each (name, module), compiled as training runs it,
    in bf16 with the first module's weights (the first: autograd's backward); a row per module, named under
    `label`, with its speed-up over the first."""
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


def sweep_tiles(
    kernel: ModuleType,
    configs: list[tuple[int, int, int, int]],
    run: Callable[[int], object],
    reference_ms: float,
    moved: int,
) -> list[dict]:
    """Time `run(rows_per_program)` with the kernel module's tile constants (BLOCK_M, BLOCK_N, NUM_WARPS) set to
    its own config first, then to each of `configs` (block_m, block_n, warps, rows_per_program); restore them;
    a row per config beside the reference's, with its bandwidth over `moved` bytes."""
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


def bench_glu(flavor, tokens: int) -> dict:
    from atma_titan.kernels.glu import triton_glu

    d, hidden, kind = flavor.d_model, flavor.mlp_hidden, flavor.mlp
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    modules = [
        ("autograd backward", AutogradMLP(d, hidden, kind)),
        ("GLU pass, PyTorch (compiled)", MLP(d, hidden, kind, "reference")),
        ("GLU pass, Triton kernel", MLP(d, hidden, kind, "triton")),
    ]
    rows = compare_backwards("mlp", modules, lambda step: step(x).backward(dout))

    fc = torch.randn(tokens, 2 * hidden, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(2 * hidden, device="cuda", dtype=torch.bfloat16)
    moved = 3 * fc.numel() * fc.element_size() + 2 * dh.numel() * dh.element_size()  # read a, g, dh; write da, dg, h
    reference = torch.compile(glu_backward_reference, fullgraph=True)
    configs = [(32, 128, 8, 1024), (16, 128, 8, 1024), (32, 256, 8, 1024), (64, 128, 8, 1024),
               (32, 128, 4, 1024), (32, 128, 4, 2048), (32, 128, 8, 512), (16, 256, 8, 2048)]  # fmt: skip
    kernels = sweep_tiles(
        triton_glu,
        configs,
        lambda rows_per_program: triton_glu.glu_backward(fc, dh, kind, bias, rows_per_program=rows_per_program),
        median_ms(lambda: reference(fc, dh, kind, bias)),
        moved,
    )
    shape = {"tokens": tokens, "d_model": d, "hidden": hidden, "kind": kind}
    return {"shape": shape, "repetitions": REPEATS, "mlp": rows, "kernel": kernels}


def bench_conv(flavor, batch: int, seq_len: int) -> dict:
    from atma_titan.kernels.short_conv import triton_short_conv as kernel

    d = flavor.d_model
    h = torch.randn(batch, seq_len, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(batch, seq_len, d, device="cuda", dtype=torch.bfloat16)
    modules = [
        ("autograd backward", AutogradGatedShortConv(flavor)),
        ("one pass, PyTorch (compiled)", GatedShortConv(dataclasses.replace(flavor, conv_impl="reference"))),
        ("one pass, Triton kernel", GatedShortConv(dataclasses.replace(flavor, conv_impl="triton"))),
    ]
    rows = compare_backwards("mixer", modules, lambda step: step(h)[0].backward(dout))

    u = torch.randn(batch, seq_len, 3 * d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(batch, seq_len, d, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(d, flavor.conv_kernel, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(3 * d, device="cuda", dtype=torch.bfloat16)
    moved = 2 * u.numel() * u.element_size() + 2 * do.numel() * do.element_size()  # read u, do; write dz, o
    reference = torch.compile(gated_conv_backward_reference, fullgraph=True)
    configs = [(16, 64, 4, 1024), (16, 128, 8, 2048), (32, 64, 8, 2048), (8, 128, 4, 1024), (8, 64, 2, 1024),
               (8, 256, 8, 1024)]  # fmt: skip
    kernels = sweep_tiles(
        kernel,
        configs,
        lambda rows_per_program: kernel.gated_conv_backward(u, do, weight, bias, rows_per_program=rows_per_program),
        median_ms(lambda: reference(u, do, weight, bias)),
        moved,
    )
    shape = {"batch": batch, "seq_len": seq_len, "d_model": d, "conv_kernel": flavor.conv_kernel}
    return {"shape": shape, "repetitions": REPEATS, "mixer": rows, "kernel": kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="?", default="glu,conv", help="comma-separated: glu, conv")
    parser.add_argument("--flavor", default="atma_370m")
    parser.add_argument("--batch", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results/)")
    args = parser.parse_args()
    ops = args.ops.split(",")
    if unknown := set(ops) - {"glu", "conv"}:
        parser.error(f"unknown ops {sorted(unknown)}: choose from glu, conv")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels/fused_backward.py needs a GPU")
    flavor = FLAVORS[args.flavor]
    meta = {"gpu": device_name(), "torch": torch.__version__}
    for op in ops:
        torch.manual_seed(0)
        print(f"== {op}")
        if op == "glu":
            result, what = bench_glu(flavor, args.batch * args.seq_len), "glu_backward"
        else:
            result, what = bench_conv(flavor, args.batch, args.seq_len), "conv_backward"
        write_json(result_path(what, args.out), meta | result)


if __name__ == "__main__":
    main()
