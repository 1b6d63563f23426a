"""Fused Polar attention against SDPA (flash and cuDNN) and the PyTorch streaming reference, on CUDA.

    python benchmarks/kernels/polar_attention.py [--lengths 2048,8192,32768,65536] [--quick] [--out PATH]
    python benchmarks/kernels/polar_attention.py --quick --backends compiled,polar_triton,sdpa_flash

Paper shape: 8 query heads, 2 KV heads, head_dim 128, bf16, causal; batch 16 at 2K, 4 at 8K, 1 at 32K and
64K. Times are `triton.testing.do_bench` medians (warm-up and autotuning excluded). FLOPs: 4*B*H*T^2*D
forward, halved for causal, backward 2.5x forward (forward+backward 3.5x). Ratios are against SDPA flash
and cuDNN in the same run. On Hopper the Polar kernels take their tiles through the copy engine;
ATMA_TRITON_COPY_ENGINE=0 times the pointer loads instead (the record says which). `compiled` times the
kernel's custom ops inside torch.compile(fullgraph), as the model runs them (against polar_triton: what
the opaque op costs). Memory: peak of one forward+backward above what was allocated before it, minus the
outputs and input gradients it leaves behind. A backend that fails is recorded as null with its error.
Results go to benchmarks/results/polar_attention-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository: atma_titan and benchmarks.common without an install

from atma_titan.kernels.polar import polar_attention_reference, polar_attention_triton  # noqa: E402
from benchmarks.common import do_bench_ms, result_path, write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
BATCH = {2048: 16, 8192: 4, 32768: 1, 65536: 1}


def batch_for(t: int) -> int:
    return BATCH.get(t, max(1, 32768 // t))


def make_inputs(b: int, t: int, device: str = "cuda", dtype=torch.bfloat16):
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=dt)

    q = randn(b, t, HEADS, HEAD_DIM)
    k = randn(b, t, KV_HEADS, HEAD_DIM)
    v = randn(b, t, KV_HEADS, HEAD_DIM)
    # per-head parameters near their initial values (docs/model.md section 3), fp32 as the model keeps them
    params = [
        -1.0 + 0.1 * randn(HEADS, dt=torch.float32),
        2.0 + 0.1 * randn(HEADS, dt=torch.float32),
        0.5 + 0.1 * randn(HEADS, dt=torch.float32),
        -1.5 + 0.1 * randn(HEADS, dt=torch.float32),
        0.1 * randn(HEADS, HEAD_DIM, dt=torch.float32),
    ]
    return [x.requires_grad_() for x in (q, k, v, *params)]


# ---------------------------------------------------------------------------------------------
# The contenders: each returns (forward, forward_backward, leaves) closures over fresh inputs
# ---------------------------------------------------------------------------------------------


def polar_case(fn, b, t, **kw):
    inputs = make_inputs(b, t)
    g_c = torch.randn(b, t, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    g_mag = torch.randn(b, t, HEADS, device="cuda", dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            return fn(*inputs, **kw)

    def forward_backward():
        c, mag = fn(*inputs, **kw)
        torch.autograd.backward((c, mag), (g_c, g_mag))
        return c, mag

    return forward, forward_backward, inputs


def sdpa_case(backend, b, t):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    q, k, v = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in make_inputs(b, t)[:3])
    g_out = torch.randn_like(q)
    note = {}

    def attend(k_in, v_in, gqa):
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k_in, v_in, is_causal=True, enable_gqa=gqa)

    try:
        with torch.no_grad():
            attend(k, v, True)
        kv = (k, v)
        gqa = True
    except RuntimeError:
        # this backend lacks native GQA: expand K/V once, outside the timed region
        group = HEADS // KV_HEADS
        kv = tuple(x.detach().repeat_interleave(group, dim=1).requires_grad_() for x in (k, v))
        gqa = False
        note["kv_expanded"] = True

    def forward():
        with torch.no_grad():
            return attend(*kv, gqa)

    def forward_backward():
        out = attend(*kv, gqa)
        out.backward(g_out)
        return out

    return forward, forward_backward, [q, *kv], note


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def causal_flops(b: int, t: int) -> float:
    return 4 * b * HEADS * t * t * HEAD_DIM / 2


def bench_ms(fn, leaves, rep: int) -> float:
    fn()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    return do_bench_ms(fn, warmup=max(rep // 4, 5), rep=rep, grad_to_none=leaves)


def extra_memory_gib(forward_backward, leaves) -> float:
    for x in leaves:
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outputs = forward_backward()
    torch.cuda.synchronize()
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    left = sum(x.numel() * x.element_size() for x in outputs)
    left += sum(x.grad.numel() * x.grad.element_size() for x in leaves if x.grad is not None)
    peak = torch.cuda.max_memory_allocated() - before - left
    for x in leaves:
        x.grad = None
    return peak / 2**30


def run_backend(name, b, t, rep):
    note = {}
    if name == "polar_triton":
        fwd, fwd_bwd, leaves = polar_case(polar_attention_triton, b, t)
    elif name == "compiled":
        fwd, fwd_bwd, leaves = polar_case(torch.compile(polar_attention_triton, fullgraph=True), b, t)
    elif name == "polar_reference":
        fwd, fwd_bwd, leaves = polar_case(polar_attention_reference, b, t, block_q=512, block_k=512)
    else:
        fwd, fwd_bwd, leaves, note = sdpa_case(name.removeprefix("sdpa_"), b, t)
    flops = causal_flops(b, t)
    fwd_ms = bench_ms(fwd, leaves, rep)
    fwd_bwd_ms = bench_ms(fwd_bwd, leaves, rep)
    return {
        "fwd_ms": fwd_ms,
        "fwd_tflops": flops / fwd_ms / 1e9,
        "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_bwd_tflops": 3.5 * flops / fwd_bwd_ms / 1e9,
        "extra_memory_gib": extra_memory_gib(fwd_bwd, leaves),
        **note,
    }


def check_against_reference(t: int) -> float:
    """Max |c - c_ref| of the kernel against the streaming reference at batch 1 (a sanity check)."""
    inputs = [x.detach() for x in make_inputs(1, t)]
    with torch.no_grad():
        c, _ = polar_attention_triton(*inputs)
        c_ref, _ = polar_attention_reference(*[x.float() for x in inputs], block_q=512, block_k=512)
    return (c.float() - c_ref).abs().max().item()


def print_table(rows):
    head = f"{'T':>6} {'B':>3} {'backend':16} {'fwd ms':>9} {'TFLOP/s':>8} {'x flash':>7} {'x cuDNN':>7} "
    head += f"{'f+b ms':>9} {'TFLOP/s':>8} {'x flash':>7} {'x cuDNN':>7} {'mem GiB':>8}"
    print(head)
    for row in rows:
        if row.get("error"):
            print(f"{row['t']:>6} {row['b']:>3} {row['backend']:16} failed: {row['error'][:70]}")
            continue

        def ratio(key, backend):
            base = next((r for r in rows if r["t"] == row["t"] and r["backend"] == backend), None)
            if not base or base.get("error") or base.get(key) is None:
                return f"{'-':>7}"
            return f"{row[key] / base[key]:7.2f}"

        print(
            f"{row['t']:>6} {row['b']:>3} {row['backend']:16} {row['fwd_ms']:9.3f} {row['fwd_tflops']:8.1f} "
            f"{ratio('fwd_tflops', 'sdpa_flash')} {ratio('fwd_tflops', 'sdpa_cudnn')} {row['fwd_bwd_ms']:9.3f} "
            f"{row['fwd_bwd_tflops']:8.1f} {ratio('fwd_bwd_tflops', 'sdpa_flash')} "
            f"{ratio('fwd_bwd_tflops', 'sdpa_cudnn')} {row['extra_memory_gib']:8.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,8192,32768,65536", help="comma-separated sequence lengths")
    parser.add_argument("--quick", action="store_true", help="2K and 8K only, shorter timing")
    parser.add_argument(
        "--backends",
        default="polar_triton,sdpa_flash,sdpa_cudnn,polar_reference",
        help="comma-separated, from polar_triton, sdpa_flash, sdpa_cudnn, polar_reference, compiled",
    )
    parser.add_argument("--reference-max-len", type=int, default=8192, help="skip the PyTorch reference above")
    parser.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")

    lengths = [2048, 8192] if args.quick else [int(x) for x in args.lengths.split(",")]
    rep = 30 if args.quick else 100
    backends = args.backends.split(",")
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}  torch {torch.__version__}  H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} bf16 causal")

    rows = []
    for t in lengths:
        b = batch_for(t)
        for name in backends:
            if name == "polar_reference" and t > args.reference_max_len:
                continue
            row = {"t": t, "b": b, "backend": name}
            try:
                row.update(run_backend(name, b, t, rep))
            except Exception as err:  # a missing backend (e.g. cuDNN) must not stop the others
                row.update(error=f"{type(err).__name__}: {err}", fwd_ms=None, fwd_bwd_ms=None)
            torch.cuda.empty_cache()
            rows.append(row)
        if t <= 8192:
            try:
                err = check_against_reference(t)
                print(f"T={t}: max |c_triton - c_reference| = {err:.3g}")
                for row in rows:
                    if row["t"] == t and row["backend"] == "polar_triton":
                        row["max_abs_err_vs_reference"] = err
            except Exception as err:  # report and go on
                print(f"T={t}: reference check failed: {err}")
    print_table(rows)

    import triton

    from atma_titan.kernels.backends import autotune_choices
    from atma_titan.kernels.polar import triton_attention

    record = {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16", "causal": True},
        "flops": "4*B*H*T^2*D/2 forward, x3.5 forward+backward",
        "results": rows,
        # the kernels' tiles through Hopper's copy engine (ATMA_TRITON_COPY_ENGINE=0: the pointer loads)
        "copy_engine": triton_attention.copy_engine(torch.device("cuda")),
        "autotune_choices": autotune_choices(triton_attention),
    }
    write_json(result_path("polar_attention", args.out), record)


if __name__ == "__main__":
    main()
