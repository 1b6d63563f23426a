"""The MLP's forward and backward as training runs it (compiled, under selective AC), with autograd's backward
of `proj(glu(fc(x)))` and with `_GLUMLP`'s (one GLU pass, atma_titan.kernels.glu), same weights, one run;
then the GLU backward kernel alone against its compiled PyTorch reference, over a few tile configs.

    python benchmarks/mlp_backward.py [--flavor atma_370m] [--tokens 32768] [--out benchmarks/results/]

Times are medians of CUDA-event timings (20 repetitions after 3 warm-ups). Needs a GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from one_pass_timing import REPEATS, compare_backwards, median_ms, sweep_tiles, write_result

from atma_titan.kernels.glu import glu, glu_backward_reference
from atma_titan.models.flavors import FLAVORS
from atma_titan.models.layers import MLP


class AutogradMLP(MLP):
    """The MLP before the hand-written backward: autograd differentiates proj(glu(fc(x)))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(glu(self.fc(x), self.kind))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="atma_370m")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/mlp_backward.py needs a GPU")
    flavor = FLAVORS[args.flavor]
    d, hidden, kind = flavor.d_model, flavor.mlp_hidden, flavor.mlp
    torch.manual_seed(0)
    x = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16)
    rows = compare_backwards(
        "mlp",
        [
            ("autograd backward", AutogradMLP(d, hidden, kind)),
            ("GLU pass, PyTorch (compiled)", MLP(d, hidden, kind, "reference")),
            ("GLU pass, Triton kernel", MLP(d, hidden, kind, "triton")),
        ],
        lambda step: step(x).backward(dout),
    )

    from atma_titan.kernels.glu import triton_glu

    fc = torch.randn(args.tokens, 2 * hidden, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(2 * hidden, device="cuda", dtype=torch.bfloat16)
    moved = 3 * fc.numel() * fc.element_size() + 2 * dh.numel() * dh.element_size()  # read a, g, dh; write da, dg, h
    compiled_reference = torch.compile(glu_backward_reference, fullgraph=True)
    configs = [(32, 128, 8, 1024), (16, 128, 8, 1024), (32, 256, 8, 1024), (64, 128, 8, 1024),
               (32, 128, 4, 1024), (32, 128, 4, 2048), (32, 128, 8, 512), (16, 256, 8, 2048)]  # fmt: skip
    kernels = sweep_tiles(
        triton_glu,
        configs,
        lambda rows_per_program: triton_glu.glu_backward(fc, dh, kind, bias, rows_per_program=rows_per_program),
        median_ms(lambda: compiled_reference(fc, dh, kind, bias)),
        moved,
    )
    result = {
        "shape": {"tokens": args.tokens, "d_model": d, "hidden": hidden, "kind": kind},
        "repetitions": REPEATS,
        "mlp": rows,
        "kernel": kernels,
    }
    write_result(args.out, "mlp_backward", result)


if __name__ == "__main__":
    main()
