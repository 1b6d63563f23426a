"""Gated delta memory kernels on one GPU: chunked training forward / forward+backward, and the decode step.

    python benchmarks/gated_delta.py [--batch 16 --seq-len 2048 --heads 8 --key-dim 128 --value-dim 128]
                                     [--decode-batch 64] [--out benchmarks/results/gated_delta-<gpu>.json]

Chunked (bf16 q, k, v; fp32 gates and state; normalize_qk=True): this Triton kernel, the PyTorch
chunked reference and fla's chunk_gated_delta_rule when fla-core is importable (its backward refuses
on some Triton / GPU pairs: the error is recorded and the time left null). Times are
triton.testing.do_bench medians in ms, with ratios to the Triton kernel.

Decode (fp32 state pool, one token per sequence): the in-place Triton step and the PyTorch step,
as achieved bandwidth 2 x state bytes / time, against a device-to-device copy of the same bytes
(dst.copy_(src)) measured in the same run.

    python benchmarks/gated_delta.py --resources [--key-dim 128 --value-dim 128]

needs no GPU: it compiles every kernel for sm_90 (bf16) and prints registers and stack bytes per
thread (stack > 0 means spills), for each autotune config, from triton's bundled cuobjdump.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atma_titan.kernels.gated_delta import (  # noqa: E402
    gated_delta_chunked,
    gated_delta_chunked_fla,
    gated_delta_chunked_triton,
    gated_delta_step_,
    gated_delta_step_inplace,
)


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def chunked_inputs(args, requires_grad: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.seq_len, args.heads)

    def randn(*size, dtype=torch.bfloat16):
        return torch.randn(*size, generator=gen, device="cuda", dtype=dtype)

    inputs = {
        "q": randn(*shape, args.key_dim),
        "k": randn(*shape, args.key_dim),
        "v": randn(*shape, args.value_dim),
        "log_gamma": F.logsigmoid(randn(*shape, dtype=torch.float32) + 3.9),
        "beta": torch.sigmoid(randn(*shape, dtype=torch.float32)),
    }
    return {name: x.requires_grad_(requires_grad) for name, x in inputs.items()}


def time_chunked(name: str, fn, args) -> dict:
    """Forward (no autograd graph) and forward + backward of r and the final state."""
    row = {"impl": name, "forward_ms": None, "forward_backward_ms": None, "error": None}
    try:
        inputs = chunked_inputs(args, requires_grad=False)
        with torch.no_grad():
            row["forward_ms"] = bench_ms(lambda: fn(**inputs))
    except Exception as error:  # noqa: BLE001 - recorded, the other rows still run
        row["error"] = f"forward: {type(error).__name__}: {error}"[:500]
        return row
    try:
        inputs = chunked_inputs(args, requires_grad=True)
        leaves = list(inputs.values())
        r, state = fn(**inputs)
        dr, dstate = torch.randn_like(r), torch.randn_like(state)

        def forward_backward():
            r, state = fn(**inputs)
            torch.autograd.backward((r, state), (dr, dstate))

        row["forward_backward_ms"] = bench_ms(forward_backward)
        for x in leaves:
            x.grad = None
    except Exception as error:  # noqa: BLE001
        row["error"] = f"backward: {type(error).__name__}: {error}"[:500]
    return row


def fla_available() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


def time_decode(args) -> list[dict]:
    heads, key_dim, value_dim, batch = args.heads, args.key_dim, args.value_dim, args.decode_batch
    pool = torch.randn(batch, heads, value_dim, key_dim, device="cuda")
    slots = torch.randperm(batch, device="cuda")
    token = {
        "q": torch.randn(batch, heads, key_dim, device="cuda", dtype=torch.bfloat16),
        "k": torch.randn(batch, heads, key_dim, device="cuda", dtype=torch.bfloat16),
        "v": torch.randn(batch, heads, value_dim, device="cuda", dtype=torch.bfloat16),
        "log_gamma": F.logsigmoid(torch.randn(batch, heads, device="cuda") + 3.9),
        "beta": torch.sigmoid(torch.randn(batch, heads, device="cuda")),
    }
    state_bytes = pool.numel() * pool.element_size()
    src, dst = torch.empty_like(pool), torch.empty_like(pool)
    rows = []
    for name, fn in (
        ("copy", lambda: dst.copy_(src)),
        ("triton_step", lambda: gated_delta_step_(pool, slots, **token)),
        ("pytorch_step", lambda: gated_delta_step_inplace(pool, slots, **token)),
    ):
        ms = bench_ms(fn, warmup=50, rep=200)
        rows.append({"impl": name, "us": ms * 1e3, "tb_per_s": 2 * state_bytes / (ms * 1e-3) / 1e12})
    copy_us = rows[0]["us"]
    for row in rows:
        row["fraction_of_copy_bandwidth"] = copy_us / row["us"]
    return rows


FP32_POINTERS = {
    "g_ptr", "inverse_ptr", "log_gamma_ptr", "beta_ptr", "du_local_ptr", "du_ptr", "dfinal_ptr", "dinitial_ptr",
    "initial_ptr", "final_ptr", "dlog_gamma_ptr", "dbeta_ptr", "pool_ptr",
}  # fmt: skip


def print_resources(args) -> None:
    """Compile each kernel for sm_90 without a GPU and print registers / stack (spills) per config."""
    import subprocess
    import tempfile

    import triton
    import triton.backends.nvidia as nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atma_titan.kernels.gated_delta import chunked, step

    dk, dv = args.key_dim, args.value_dim
    bk = max(16, triton.next_power_of_2(dk))
    common = {"H": args.heads, "DK": dk, "DV": dv, "BK": bk, "C": chunked.CHUNK, "NORMALIZE": True, "PREC": "tf32"}
    single = [triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)]
    kernels = [
        ("prepare", chunked._prepare_kernel, {**common, "BVF": max(16, triton.next_power_of_2(dv))}, single),
        ("state_fwd", chunked._state_fwd_kernel.fn, {**common, "HAS_INITIAL": True}, chunked.SEQUENTIAL_CONFIGS),
        ("output", chunked._output_kernel.fn, common, chunked.PARALLEL_CONFIGS),
        ("dv_local", chunked._dv_local_kernel.fn, common, chunked.PARALLEL_CONFIGS),
        ("state_bwd", chunked._state_bwd_kernel.fn, common, chunked.SEQUENTIAL_CONFIGS),
        ("grad", chunked._grad_kernel.fn, common, chunked.GRAD_CONFIGS),
        ("step", step._step_kernel, {"H": args.heads, "DK": dk, "DV": dv, "BK": bk, "BV": step.ROWS_PER_PROGRAM,
                                     "NORMALIZE": True}, [triton.Config({}, num_warps=step.NUM_WARPS)]),
    ]  # fmt: skip
    cuobjdump = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    for name, fn, constants, configs in kernels:
        for config in configs:
            constexprs = {**{k: v for k, v in constants.items() if k in fn.arg_names}, **config.kwargs}
            signature = {
                arg: "constexpr"
                if arg in constexprs
                else ("*fp32" if arg in FP32_POINTERS else "*bf16")
                if arg.endswith("_ptr")
                else "i32"
                for arg in fn.arg_names
            }
            if name == "step":
                signature["slots_ptr"] = "*i64"
            source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(compiled.asm["cubin"])
                cubin.flush()
                usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True)
            found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
            regs, stack = found.groups() if found else ("?", "?")
            print(f"{name:<10} {str(config.kwargs):<12} warps={config.num_warps:<2} stages={config.num_stages} "
                  f"regs={regs:>3} stack={stack:>5} shared={compiled.metadata.shared}")  # fmt: skip


def gpu_slug() -> str:
    name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--key-dim", type=int, default=128)
    parser.add_argument("--value-dim", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--skip-reference", action="store_true", help="leave out the PyTorch chunked reference")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--resources", action="store_true", help="registers / spills per kernel config (no GPU)")
    args = parser.parse_args()
    if args.resources:
        print_resources(args)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gated_delta.py needs a CUDA device")

    impls = [("triton", gated_delta_chunked_triton)]
    if not args.skip_reference:
        impls.append(("pytorch_chunked", gated_delta_chunked))
    if fla_available():
        impls.append(("fla", gated_delta_chunked_fla))
    chunked = [time_chunked(name, fn, args) for name, fn in impls]
    decode = time_decode(args)

    base = chunked[0]
    print(f"chunked gated delta  B{args.batch} T{args.seq_len} H{args.heads} dk{args.key_dim} dv{args.value_dim} bf16")
    print(f"{'impl':<16} {'fwd ms':>9} {'fwd+bwd ms':>11} {'fwd / triton':>13} {'f+b / triton':>13}")
    for row in chunked:
        fwd, both = row["forward_ms"], row["forward_backward_ms"]
        fwd_ratio = fwd / base["forward_ms"] if fwd and base["forward_ms"] else None
        both_ratio = both / base["forward_backward_ms"] if both and base["forward_backward_ms"] else None
        print(f"{row['impl']:<16} {_fmt(fwd, 9)} {_fmt(both, 11)} {_fmt(fwd_ratio, 13)} {_fmt(both_ratio, 13)}")
        if row["error"]:
            print(f"    error: {row['error'][:200]}")
    print(f"\ndecode step  B{args.decode_batch} H{args.heads} {args.value_dim}x{args.key_dim} fp32 state")
    print(f"{'impl':<16} {'us':>9} {'TB/s':>7} {'of copy bw':>11}")
    for row in decode:
        print(f"{row['impl']:<16} {row['us']:>9.2f} {row['tb_per_s']:>7.2f} {row['fraction_of_copy_bandwidth']:>11.1%}")

    import triton

    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": vars(args) | {"out": None},
        "chunked": chunked,
        "decode": decode,
    }
    out = args.out or Path(__file__).parent / "results" / f"gated_delta-{gpu_slug()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {out}")


def _fmt(x, width: int) -> str:
    return f"{x:>{width}.3f}" if x is not None else f"{'-':>{width}}"


if __name__ == "__main__":
    main()
