"""What keeping documents apart costs each mixer kernel: its time with doc_start against without, on one GPU.

    python benchmarks/kernels/document_mask.py [--lengths 2048,8192,32768] [--tokens 32768]
                                               [--docs one,1k,fineweb] [--kernels polar,gated_delta,conv]
                                               [--runs 20] [--flavor atma_370m] [--out PATH]
    python benchmarks/kernels/document_mask.py --dry-run      # CPU: the length sampler and doc_start only

The kernels, at the flavor's shapes (atma_370m: 8 query heads, 2 KV heads of 128, d_model 1,024, conv
kernel 3), bf16, B = tokens / T sequences of T (32K tokens a batch):

- polar: the fused Polar attention (kernels/polar, polar_attention_triton), forward + backward of c and mag;
- gated_delta: the chunked gated-delta memory (kernels/gated_delta, gated_delta_chunked_triton), forward +
  backward of r (training uses r only; k and v already expanded to the query heads, as models/memory.py does);
- conv: the gated short convolution's one-pass backward (kernels/short_conv, gated_conv_backward, triton).

Document lengths, three distributions: `one` (one document a window: doc_start is all zero, so the masked
time is the masked code path's own overhead), `1k` (exponential with mean 1,024 tokens, at least 1) and
`fineweb` (a heavy tail like FineWeb-Edu's). The documents of a batch are drawn as one stream and the
stream cut into windows as data/packing.py cuts it: a document runs on into the next window, whose
position 0 continues it. doc_start comes from kernels/documents.doc_start_from_flags, built outside the
timing; what a kernel derives from it (positions in documents, key ranges, resets) is timed.

Times are medians of --runs CUDA-event timings (benchmarks.common.median_ms, 20 by default) after 3 warm-up
calls (compiling and autotuning), the unmasked time once per kernel and length on the same inputs as the
masked ones. A kernel that fails (e.g. one without doc_start yet) is recorded with its error.
Results go to benchmarks/results/document_mask-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository: atma_titan and benchmarks.common without an install

from atma_titan.kernels.documents import check_doc_start, doc_start_from_flags, positions_in_document  # noqa: E402
from atma_titan.models.flavors import FLAVORS, ModelArgs  # noqa: E402
from benchmarks.common import (  # noqa: E402
    FINEWEB_MEDIAN,
    FINEWEB_SIGMA,
    MEAN_1K,
    REPEATS,
    SAMPLERS,
    device_name,
    document_lengths,
    median_ms,
    result_path,
    write_json,
)

LENGTHS = (2048, 8192, 32768)
TOKENS = 32768
KERNELS = ("polar", "gated_delta", "conv")

# ---------------------------------------------------------------------------------------------
# Document lengths and doc_start
# ---------------------------------------------------------------------------------------------


def packed_doc_start(kind: str, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """int32 doc_start (batch, seq_len) of `batch` consecutive windows of one stream of `kind` documents."""
    flags = torch.zeros(batch * seq_len, dtype=torch.bool)
    if SAMPLERS[kind] is not None:
        gen = torch.Generator().manual_seed(seed)
        starts = document_lengths(kind, batch * seq_len, gen).cumsum(0)  # where the 2nd, 3rd, ... documents begin
        flags[starts[starts < flags.numel()]] = True
    return doc_start_from_flags(flags.view(batch, seq_len))


def documents_per_window(doc_start: torch.Tensor) -> float:
    """The mean number of documents (pieces of documents included) in a window."""
    return float((positions_in_document(doc_start) == 0).sum(-1).double().mean())


def check_packing(doc_start: torch.Tensor) -> None:
    """doc_start follows kernels/documents.py's convention: 0 at position 0, each value t or the one before."""
    positions = torch.arange(doc_start.shape[-1], dtype=doc_start.dtype)
    assert doc_start.dtype == torch.int32 and bool((doc_start[:, 0] == 0).all())
    continues = doc_start[:, 1:] == doc_start[:, :-1]
    assert bool((continues | (doc_start[:, 1:] == positions[1:])).all()), "a doc_start neither begins nor continues"


def check_samplers(n: int = 400_000) -> dict[str, dict[str, float]]:
    """The sampled lengths' mean and median against their distributions' (a self-check on the CPU)."""
    gen = torch.Generator().manual_seed(1)
    stats = {}
    for kind in ("1k", "fineweb"):
        lengths = document_lengths(kind, n * 1200, gen)[:n].double()  # ~1K tokens a document
        stats[kind] = {"mean": float(lengths.mean()), "median": float(lengths.median())}
    assert abs(stats["1k"]["mean"] / MEAN_1K - 1) < 0.02, stats
    assert abs(stats["fineweb"]["median"] / FINEWEB_MEDIAN - 1) < 0.02, stats
    want_mean = FINEWEB_MEDIAN * math.exp(FINEWEB_SIGMA**2 / 2)
    assert abs(stats["fineweb"]["mean"] / want_mean - 1) < 0.03, stats
    return stats


# ---------------------------------------------------------------------------------------------
# The kernels: each returns step(doc_start) -> None, one timed call over fixed inputs
# ---------------------------------------------------------------------------------------------


def _randn(gen: torch.Generator, *shape, dtype=torch.bfloat16, requires_grad=False) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype).requires_grad_(requires_grad)


def polar_step(args: ModelArgs, batch: int, seq_len: int):
    from atma_titan.kernels.polar import polar_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim = args.n_heads, args.n_kv_heads, args.head_dim
    q = _randn(gen, batch, seq_len, heads, dim, requires_grad=True)
    k, v = (_randn(gen, batch, seq_len, kv_heads, dim, requires_grad=True) for _ in range(2))
    # per-head parameters near their initial values (docs/model.md section 3), fp32 as the model keeps them
    params = [
        (shift + 0.1 * _randn(gen, *shape, dtype=torch.float32)).requires_grad_()
        for shift, shape in [(-1.0, (heads,)), (2.0, (heads,)), (0.5, (heads,)), (-1.5, (heads,)), (0.0, (heads, dim))]
    ]
    leaves = [q, k, v, *params]
    g_c, g_mag = _randn(gen, batch, seq_len, heads, dim), _randn(gen, batch, seq_len, heads)

    def step(doc_start):
        masked = {} if doc_start is None else {"doc_start": doc_start}
        c, mag = polar_attention_triton(*leaves, **masked)
        torch.autograd.grad((c, mag), leaves, (g_c, g_mag))

    return step


def gated_delta_step(args: ModelArgs, batch: int, seq_len: int):
    from atma_titan.kernels.gated_delta import gated_delta_chunked_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, seq_len, args.n_heads)
    q, k, v = (_randn(gen, *shape, args.head_dim, requires_grad=True) for _ in range(3))
    # gates as models/memory.py draws them: retention ~0.98, fp32
    log_gamma = F.logsigmoid(_randn(gen, *shape, dtype=torch.float32) + 3.9).requires_grad_()
    beta = torch.sigmoid(_randn(gen, *shape, dtype=torch.float32)).requires_grad_()
    leaves = [q, k, v, log_gamma, beta]
    dr = _randn(gen, *shape, args.head_dim)

    def step(doc_start):
        masked = {} if doc_start is None else {"doc_start": doc_start}
        r, _ = gated_delta_chunked_triton(*leaves, **masked)
        torch.autograd.grad(r, leaves, dr)

    return step


def conv_step(args: ModelArgs, batch: int, seq_len: int):
    from atma_titan.kernels.short_conv import gated_conv_backward

    gen = torch.Generator(device="cuda").manual_seed(0)
    d = args.d_model
    u, do = _randn(gen, batch, seq_len, 3 * d), _randn(gen, batch, seq_len, d)
    weight, bias = _randn(gen, d, args.conv_kernel), _randn(gen, 3 * d)

    def step(doc_start):
        gated_conv_backward(u, do, weight, bias, doc_start, impl="triton")

    return step


STEPS = {"polar": polar_step, "gated_delta": gated_delta_step, "conv": conv_step}
WHAT = {
    "polar": "polar_attention_triton, forward + backward",
    "gated_delta": "gated_delta_chunked_triton, forward + backward of r",
    "conv": "gated_conv_backward (impl=triton)",
}


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"[:500]


def measure(kernel: str, args: ModelArgs, seq_len: int, tokens: int, docs: list[str], runs: int) -> list[dict]:
    """A row per distribution: the kernel's unmasked time (measured once) and its time with that doc_start."""
    batch = max(tokens // seq_len, 1)
    base = {"kernel": kernel, "t": seq_len, "b": batch}
    try:
        step = STEPS[kernel](args, batch, seq_len)
        plain = median_ms(lambda: step(None), repeats=runs)
    except Exception as err:  # a kernel that cannot run must not stop the others
        return [{**base, "docs": kind, "plain_ms": None, "masked_ms": None, "error": _error(err)} for kind in docs]
    rows = []
    for kind in docs:
        doc_start = packed_doc_start(kind, batch, seq_len, seed=seq_len)
        row = {**base, "docs": kind, "docs_per_window": documents_per_window(doc_start), "plain_ms": plain}
        doc_start = doc_start.cuda()
        try:
            row["masked_ms"] = median_ms(lambda: step(doc_start), repeats=runs)
            row["ratio"] = row["masked_ms"] / plain
        except Exception as err:
            row.update(masked_ms=None, ratio=None, error=_error(err))
        rows.append(row)
    return rows


def print_table(rows: list[dict], runs: int) -> None:
    print(f"ms: medians of {runs} runs; ratio: masked / unmasked")
    print(f"{'kernel':12} {'T':>6} {'B':>3} {'docs':8} {'docs/win':>8} {'unmasked':>9} {'masked':>9} {'ratio':>6}")
    for row in rows:
        head = f"{row['kernel']:12} {row['t']:>6} {row['b']:>3} {row['docs']:8}"
        if row.get("error"):
            print(f"{head} failed: {row['error'][:80]}")
            continue
        print(
            f"{head} {row['docs_per_window']:8.1f} {row['plain_ms']:9.3f} {row['masked_ms']:9.3f} {row['ratio']:6.3f}"
        )


def dry_run(lengths: list[int], tokens: int, docs: list[str]) -> None:
    """The CPU part: the samplers against their distributions, and each doc_start the GPU run would build."""
    for kind, stats in check_samplers().items():
        print(f"{kind:8} sampled lengths: mean {stats['mean']:7.1f}, median {stats['median']:7.1f}")
    print(f"{'T':>6} {'B':>3} {'docs':8} {'docs/win':>8} {'tokens/doc':>10}")
    for seq_len in lengths:
        batch = max(tokens // seq_len, 1)
        for kind in docs:
            doc_start = packed_doc_start(kind, batch, seq_len, seed=seq_len)
            check_doc_start(doc_start, batch, seq_len)
            check_packing(doc_start)
            per_window = documents_per_window(doc_start)
            print(f"{seq_len:>6} {batch:>3} {kind:8} {per_window:8.1f} {seq_len / per_window:10.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated sequence lengths")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens a batch: B = tokens / T")
    parser.add_argument("--docs", default=",".join(SAMPLERS), help=f"comma-separated, from {', '.join(SAMPLERS)}")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, from {', '.join(KERNELS)}")
    parser.add_argument("--runs", type=int, default=REPEATS, help="timed runs a row (the median is reported)")
    parser.add_argument("--flavor", default="atma_370m", choices=sorted(FLAVORS), help="the model's shapes")
    parser.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    parser.add_argument("--dry-run", action="store_true", help="CPU only: check the sampler and doc_start, no kernels")
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.docs, args.kernels = args.docs.split(","), args.kernels.split(",")
    if unknown := set(args.docs) - set(SAMPLERS):
        parser.error(f"unknown --docs {sorted(unknown)}: choose from {', '.join(SAMPLERS)}")
    if unknown := set(args.kernels) - set(KERNELS):
        parser.error(f"unknown --kernels {sorted(unknown)}: choose from {', '.join(KERNELS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args.lengths, args.tokens, args.docs)
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels/document_mask.py needs a GPU (--dry-run runs on the CPU)")
    flavor = FLAVORS[args.flavor]
    print(f"{device_name()}  torch {torch.__version__}  {args.flavor}: {args.tokens:,} tokens a batch, bf16")
    rows = []
    for kernel in args.kernels:
        for seq_len in args.lengths:
            rows += measure(kernel, flavor, seq_len, args.tokens, args.docs, args.runs)
            torch.cuda.empty_cache()  # the inputs of one length are gone before the next is allocated
    print_table(rows, args.runs)

    import triton

    record = {
        "gpu": device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flavor": args.flavor,
        "shape": {
            "tokens": args.tokens,
            "heads": flavor.n_heads,
            "kv_heads": flavor.n_kv_heads,
            "head_dim": flavor.head_dim,
            "d_model": flavor.d_model,
            "conv_kernel": flavor.conv_kernel,
            "dtype": "bfloat16",
        },
        "kernels": {kernel: WHAT[kernel] for kernel in args.kernels},
        "docs": {
            "one": "one document a window (doc_start all zero)",
            "1k": f"exponential lengths, mean {MEAN_1K:.0f}, at least 1",
            "fineweb": f"log-normal lengths, median {FINEWEB_MEDIAN:.0f}, sigma {FINEWEB_SIGMA} (an assumed fit)",
        },
        "runs": args.runs,
        "timing": "median of CUDA-event timings after 3 warm-up calls; ratio = masked / unmasked",
        "results": rows,
    }
    write_json(result_path("document_mask", args.out), record)


if __name__ == "__main__":
    main()
