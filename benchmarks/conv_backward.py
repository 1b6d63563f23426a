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
import json
from pathlib import Path

import torch
from one_pass_timing import REPEATS, as_training_runs, median_ms, sweep_tiles

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
    rows = []
    base = AutogradGatedShortConv(flavor).cuda().bfloat16()
    for name, module in [
        ("autograd backward", base),
        ("one pass, PyTorch (compiled)", GatedShortConv(dataclasses.replace(flavor, conv_impl="reference"))),
        ("one pass, Triton kernel", GatedShortConv(dataclasses.replace(flavor, conv_impl="triton"))),
    ]:
        module = module.cuda().bfloat16()
        module.load_state_dict(base.state_dict())
        step = as_training_runs(module)
        ms = median_ms(lambda: step(h)[0].backward(dout))
        rows.append({"mixer": name, "forward_backward_ms": ms})
    for row in rows:
        row["vs_autograd"] = rows[0]["forward_backward_ms"] / row["forward_backward_ms"]
        print(f"{row['mixer']:32s} {row['forward_backward_ms']:8.3f} ms  {row['vs_autograd']:.3f}x")

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
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"batch": args.batch, "seq_len": args.seq_len, "d_model": d, "conv_kernel": flavor.conv_kernel},
        "repetitions": REPEATS,
        "mixer": rows,
        "kernel": kernels,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"conv_backward-{torch.cuda.get_device_name().split()[-1].lower()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
