"""The LFM2 conv block's mixer (GatedShortConv) forward and backward as training runs it (compiled, under
selective AC), with autograd's backward of `out_proj(c * conv(b * x))` and with `_GatedConv`'s (one pass,
atma_titan.kernels.short_conv), same weights, one run; then the backward kernel alone against its compiled
PyTorch reference, over a few tile configs.

    python benchmarks/conv_backward.py [--flavor atma_370m] [--batch 16] [--seq-len 2048] [--out benchmarks/results/]

Times are medians of CUDA-event timings (20 repetitions after 3 warm-ups). Needs a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from one_pass_timing import REPEATS, compare_backwards, median_ms, sweep_tiles, write_result

from atma_titan.kernels.short_conv import gated_conv_backward_reference
from atma_titan.models.conv import GatedShortConv
from atma_titan.models.flavors import FLAVORS


class AutogradGatedShortConv(GatedShortConv):
    """The mixer before the hand-written backward: autograd differentiates out_proj(c * conv(b * x))."""

    def forward(self, h: torch.Tensor, cache=None):
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        return self.out_proj(c * self.conv(b * x)), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="atma_370m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/conv_backward.py needs a GPU")
    flavor = FLAVORS[args.flavor]
    d = flavor.d_model
    torch.manual_seed(0)
    h = torch.randn(args.batch, args.seq_len, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(args.batch, args.seq_len, d, device="cuda", dtype=torch.bfloat16)
    rows = compare_backwards(
        "mixer",
        [
            ("autograd backward", AutogradGatedShortConv(flavor)),
            ("one pass, PyTorch (compiled)", GatedShortConv(dataclasses.replace(flavor, conv_impl="reference"))),
            ("one pass, Triton kernel", GatedShortConv(dataclasses.replace(flavor, conv_impl="triton"))),
        ],
        lambda step: step(h)[0].backward(dout),
    )

    from atma_titan.kernels.short_conv import triton_short_conv as kernel

    u = torch.randn(args.batch, args.seq_len, 3 * d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(args.batch, args.seq_len, d, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(d, flavor.conv_kernel, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(3 * d, device="cuda", dtype=torch.bfloat16)
    moved = 2 * u.numel() * u.element_size() + 2 * do.numel() * do.element_size()  # read u, do; write dz, o
    compiled_reference = torch.compile(gated_conv_backward_reference, fullgraph=True)
    configs = [(16, 64, 4, 1024), (16, 128, 8, 2048), (32, 64, 8, 2048), (8, 128, 4, 1024), (8, 64, 2, 1024),
               (8, 256, 8, 1024)]  # fmt: skip
    kernels = sweep_tiles(
        kernel,
        configs,
        lambda rows_per_program: kernel.gated_conv_backward(u, do, weight, bias, rows_per_program=rows_per_program),
        median_ms(lambda: compiled_reference(u, do, weight, bias)),
        moved,
    )
    result = {
        "shape": {"batch": args.batch, "seq_len": args.seq_len, "d_model": d, "conv_kernel": flavor.conv_kernel},
        "repetitions": REPEATS,
        "mixer": rows,
        "kernel": kernels,
    }
    write_result(args.out, "conv_backward", result)


if __name__ == "__main__":
    main()
