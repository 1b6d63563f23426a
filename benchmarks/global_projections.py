"""A global block's projections of its input as one matrix product against one product per projection.

    python benchmarks/global_projections.py [--tokens 32768] [--repeats 30]

The projections are q with its output gate, k, v and the memory's gamma, beta and gate
(`atma_titan.models.layers.fused_linear`; 370M widths: d 1,024 -> 2,048 + 256 + 256 + 8 + 8 + 1,024). Each
form runs forward and backward (x's gradient and every weight's), in bf16 on a GPU, eager and compiled
(the trainer compiles each block). Figures are medians of --repeats runs timed with CUDA events after a
warm-up. The "one product" ratio is to the per-projection form in the same process.
Results: benchmarks/results/global_projections-<gpu>.json.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from atma_titan.models.attention import GlobalAttention
from atma_titan.models.layers import fused_linear
from one_pass_timing import median_ms, micro_batch_benchmark, write_result


def apart(x, linears):
    return [F.linear(x, linear.weight, linear.bias) for linear in linears]


def step(form, x, linears, probes):
    """Forward, then the gradients of x and every weight and bias from a fixed probe per output (what the
    block's later ops would send back)."""
    outputs = form(x, linears)
    params = [p for linear in linears for p in (linear.weight, linear.bias)]
    torch.autograd.grad(outputs, [x, *params], probes)


def main() -> None:
    args, model_args = micro_batch_benchmark(__doc__, "global_projections.py")
    block = GlobalAttention(model_args).cuda().bfloat16()
    linears = [block.q_proj, block.k_proj, block.v_proj, *block.memory.input_projections()]
    x = torch.randn(args.tokens, model_args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probes = [torch.randn(args.tokens, linear.out_features, device="cuda", dtype=torch.bfloat16) for linear in linears]
    rows = []
    for mode in ("eager", "compiled"):
        timed = {}
        for name, form in (("one product per projection", apart), ("one product (fused_linear)", fused_linear)):
            run = torch.compile(form) if mode == "compiled" else form
            timed[name] = median_ms(lambda: step(run, x, linears, probes), args.repeats)
        base = timed["one product per projection"]
        for name, ms in timed.items():
            rows.append({"mode": mode, "form": name, "ms": ms, "speedup": base / ms})
            print(f"{mode:9s} {name:28s} {ms:7.3f} ms  {base / ms:5.2f}x", flush=True)
    meta = {"tokens": args.tokens, "repeats": args.repeats, "widths": [lin.out_features for lin in linears]}
    write_result(args.out, "global_projections", {**meta, "rows": rows})


if __name__ == "__main__":
    main()
