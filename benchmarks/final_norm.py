"""The model's final RMSNorm, forward and backward, run eagerly against compiled (as apply_compile now runs it).

    python benchmarks/final_norm.py [--tokens 32768] [--repeats 30]

The norm sits between the last block and the head, outside both, so until it was compiled on its own it
ran eagerly: an fp32 upcast, pow, mean, rsqrt, two multiplications and a cast forward, and autograd's
backward of each. Here it runs on a micro-batch of the 370M's hidden states in bf16 with a bf16 weight
(FSDP2 gathers parameters in bf16), forward plus the gradients of its input and weight from a fixed
probe. Figures are medians of --repeats runs timed with CUDA events after a warm-up; the ratio is to the
eager form in the same process. Results: benchmarks/results/final_norm-<gpu>.json.
"""

from __future__ import annotations

import torch

from atma_titan.models.layers import RMSNorm
from one_pass_timing import median_ms, micro_batch_benchmark, write_result


def main() -> None:
    args, model_args = micro_batch_benchmark(__doc__, "final_norm.py")
    norm = RMSNorm(model_args.d_model, model_args.norm_eps).cuda().bfloat16()
    x = torch.randn(args.tokens, model_args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probe = torch.randn_like(x)
    rows, base = [], None
    for name, run in (("eager", norm), ("compiled", torch.compile(norm, fullgraph=True))):
        ms = median_ms(lambda: torch.autograd.grad(run(x), [x, norm.weight], probe), args.repeats)
        base = base or ms
        rows.append({"form": name, "ms": ms, "speedup": base / ms})
        print(f"{name:9s} {ms:7.3f} ms  {base / ms:5.2f}x", flush=True)
    meta = {"tokens": args.tokens, "d_model": model_args.d_model, "repeats": args.repeats}
    write_result(args.out, "final_norm", {**meta, "rows": rows})


if __name__ == "__main__":
    main()
