"""Gated delta memory kernels on one GPU: chunked training forward / forward+backward, and the decode step.

    python benchmarks/kernels/gated_delta.py [--batch 16 --seq-len 2048 --heads 8 --key-dim 128 --value-dim 128]
                                             [--decode-batch 64] [--step-sweep]
                                             [--out benchmarks/results/ | --out FILE.json]

Chunked (bf16 q, k, v; fp32 gates and state; normalize_qk=True): this Triton kernel, the PyTorch
chunked reference and fla's chunk_gated_delta_rule when fla-core is importable (its backward refuses
on some Triton / GPU pairs: the error is recorded and the time left null). Times are
triton.testing.do_bench medians in ms, with ratios to the Triton kernel.

Decode (fp32 state pool, one token per sequence): the in-place Triton step and the PyTorch step,
as achieved bandwidth 2 x state bytes / time, against a device-to-device copy of the same bytes
(dst.copy_(src)) measured in the same run. Each is timed twice: eagerly (do_bench of one call, so
Python / custom-op dispatch is included: at ~20 us a step that overhead dominates) and inside a
CUDA graph, as a decode loop runs it (20 steps captured into one graph after warm-up, the replay
timed, per step). In the graph the steps rotate over 4 disjoint slot sets (copies over 4 buffer
pairs) so consecutive steps do not find their state in the 50 MB L2. --step-sweep also times the
step kernel's rows per program x warps in the graph. --out takes a directory (gated_delta-<gpu>-<date>.json
is written in it) or a .json file.

    python benchmarks/kernels/gated_delta.py --resources [--key-dim 128 --value-dim 128] [--kernels prepare,grad_output]

needs no GPU: it compiles every kernel for sm_90 (bf16) and prints registers and stack bytes per
thread (stack > 0 means spills), for each autotune config, from triton's bundled cuobjdump.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.kernels.gated_delta import (  # noqa: E402
    gated_delta_chunked,
    gated_delta_chunked_fla,
    gated_delta_chunked_triton,
    gated_delta_step_,
    gated_delta_step_inplace,
)
from benchmarks.common import do_bench_ms, result_path, write_json  # noqa: E402


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
            row["forward_ms"] = do_bench_ms(lambda: fn(**inputs))
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

        row["forward_backward_ms"] = do_bench_ms(forward_backward)
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


GRAPH_STEPS = 20  # steps captured into one CUDA graph
ROTATIONS = 4  # disjoint slot sets / buffer pairs the graphed steps cycle through (more bytes than the L2)


def graph_us(step_fns) -> float:
    """Per-step time of len(step_fns) calls captured in one CUDA graph (warm-up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in step_fns[:ROTATIONS] * 2:  # compile / autotune / allocator warm-up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in step_fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return do_bench_ms(graph.replay, warmup=10, rep=100) * 1e3 / len(step_fns)


def decode_setup(args) -> dict:
    heads, key_dim, value_dim, batch = args.heads, args.key_dim, args.value_dim, args.decode_batch
    pool = torch.randn(ROTATIONS * batch, heads, value_dim, key_dim, device="cuda")
    order = torch.randperm(ROTATIONS * batch, device="cuda")
    slot_sets = [order[i * batch : (i + 1) * batch].contiguous() for i in range(ROTATIONS)]
    token = {
        "q": torch.randn(batch, heads, key_dim, device="cuda", dtype=torch.bfloat16),
        "k": torch.randn(batch, heads, key_dim, device="cuda", dtype=torch.bfloat16),
        "v": torch.randn(batch, heads, value_dim, device="cuda", dtype=torch.bfloat16),
        "log_gamma": F.logsigmoid(torch.randn(batch, heads, device="cuda") + 3.9),
        "beta": torch.sigmoid(torch.randn(batch, heads, device="cuda")),
    }
    state_bytes = batch * heads * value_dim * key_dim * 4
    buffers = [(torch.empty_like(pool[:batch]), torch.empty_like(pool[:batch])) for _ in range(ROTATIONS)]
    return {"pool": pool, "slot_sets": slot_sets, "token": token, "state_bytes": state_bytes, "buffers": buffers}


def time_decode(args) -> list[dict]:
    d = decode_setup(args)
    pool, slot_sets, token, buffers = d["pool"], d["slot_sets"], d["token"], d["buffers"]

    def copy(i):
        src, dst = buffers[i % ROTATIONS]
        return lambda: dst.copy_(src)

    def triton_step(i):
        return lambda: gated_delta_step_(pool, slot_sets[i % ROTATIONS], **token)

    def pytorch_step(i):
        return lambda: gated_delta_step_inplace(pool, slot_sets[i % ROTATIONS], **token)

    rows = []
    for name, make in (("copy", copy), ("triton_step", triton_step), ("pytorch_step", pytorch_step)):
        row = {"impl": name, "us": None, "tb_per_s": None, "graph_us": None, "graph_tb_per_s": None, "error": None}
        row["us"] = do_bench_ms(make(0), warmup=50, rep=200) * 1e3
        try:
            row["graph_us"] = graph_us([make(i) for i in range(GRAPH_STEPS)])
        except Exception as error:  # noqa: BLE001 - recorded, the eager time still stands
            row["error"] = f"graph: {type(error).__name__}: {error}"[:500]
            torch.cuda.synchronize()
        rows.append(row)
    _bandwidths(rows, d["state_bytes"])
    return rows


def _bandwidths(rows: list[dict], state_bytes: int) -> None:
    """TB/s (2 x state bytes per step) and fraction of the copy's bandwidth, eager and graphed."""
    copy = rows[0]
    for row in rows:
        for prefix in ("", "graph_"):
            us = row[f"{prefix}us"]
            row[f"{prefix}tb_per_s"] = 2 * state_bytes / (us * 1e-6) / 1e12 if us else None
            base = copy[f"{prefix}us"]
            row[f"{prefix}fraction_of_copy_bandwidth"] = base / us if us and base else None


def sweep_step(args) -> list[dict]:
    """The Triton step inside a CUDA graph for each rows-per-program x warps (defaults restored after)."""
    from atma_titan.kernels.gated_delta import triton_step as step

    d = decode_setup(args)
    pool, slot_sets, token = d["pool"], d["slot_sets"], d["token"]
    defaults = step.ROWS_PER_PROGRAM, step.NUM_WARPS
    rows = []
    try:
        for rows_per_program in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                step.ROWS_PER_PROGRAM, step.NUM_WARPS = rows_per_program, warps
                fns = [
                    (lambda s: lambda: gated_delta_step_(pool, s, **token))(slot_sets[i % ROTATIONS])
                    for i in range(GRAPH_STEPS)
                ]
                us = graph_us(fns)
                rows.append({"rows_per_program": rows_per_program, "num_warps": warps, "graph_us": us,
                             "graph_tb_per_s": 2 * d["state_bytes"] / (us * 1e-6) / 1e12})  # fmt: skip
    finally:
        step.ROWS_PER_PROGRAM, step.NUM_WARPS = defaults
    return rows


FP32_POINTERS = {
    "g_ptr", "log_gamma_ptr", "beta_ptr", "du_local_ptr", "du_ptr", "dfinal_ptr", "dinitial_ptr",
    "dk_partial_ptr", "dg_partial_ptr", "initial_ptr", "final_ptr", "dlog_gamma_ptr", "dbeta_ptr", "pool_ptr",
}  # fmt: skip


def print_resources(args) -> None:
    """Compile each kernel for sm_90 without a GPU and print registers / stack (spills) per config."""
    import subprocess
    import tempfile

    import triton
    import triton.backends.nvidia as nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atma_titan.kernels.gated_delta import triton_chunked as chunked
    from atma_titan.kernels.gated_delta import triton_step as step

    dk, dv = args.key_dim, args.value_dim
    bk = chunked._block(dk)
    common = {"H": args.heads, "DK": dk, "DV": dv, "BK": bk, "C": chunked.CHUNK, "NORMALIZE": True, "PREC": "tf32"}
    single = [triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)]
    kernels = [
        ("prepare", chunked._prepare_kernel,
         {**common, "BVF": chunked._block(dv), "INV_PREC": chunked._inverse_precision("tf32"), "STORE_INVERSE": True},
         single),
        ("state_fwd", chunked._state_fwd_kernel.fn, {**common, "HAS_INITIAL": True}, chunked.SEQUENTIAL_CONFIGS),
        ("output", chunked._output_kernel.fn, common, chunked.PARALLEL_CONFIGS),
        ("dv_local", chunked._dv_local_kernel.fn, common, chunked.PARALLEL_CONFIGS),
        ("state_bwd", chunked._state_bwd_kernel.fn, common, chunked.SEQUENTIAL_CONFIGS),
        ("grad_transform", chunked._grad_transform_kernel.fn, common, chunked.GRAD_CONFIGS),
        ("grad_output", chunked._grad_output_kernel.fn, common, chunked.GRAD_CONFIGS),
        ("step", step._step_kernel, {"H": args.heads, "DK": dk, "DV": dv, "BK": max(16, triton.next_power_of_2(dk)),
                                     "BV": step.ROWS_PER_PROGRAM,
                                     "NORMALIZE": True}, [triton.Config({}, num_warps=step.NUM_WARPS)]),
    ]  # fmt: skip
    cuobjdump = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    for name, fn, constants, configs in kernels:
        if args.kernels and name not in args.kernels.split(","):
            continue
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
            # as a launch specialises them: 16-byte aligned pointers, T divisible by 16 when it is
            aligned = [
                i
                for i, arg in enumerate(fn.arg_names)
                if arg.endswith("_ptr") or (arg == "T" and args.seq_len % 16 == 0)
            ]
            source = ASTSource(
                fn,
                signature,
                constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
            )
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--key-dim", type=int, default=128)
    parser.add_argument("--value-dim", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--skip-reference", action="store_true", help="leave out the PyTorch chunked reference")
    parser.add_argument("--out", type=Path, default=None, help="a results folder or a .json file")
    parser.add_argument("--step-sweep", action="store_true", help="also time step rows-per-program x warps in a graph")
    parser.add_argument("--resources", action="store_true", help="registers / spills per kernel config (no GPU)")
    parser.add_argument("--kernels", default="", help="with --resources: only these kernels (comma-separated names)")
    args = parser.parse_args()
    if args.resources:
        print_resources(args)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels/gated_delta.py needs a CUDA device")

    impls = [("triton", gated_delta_chunked_triton)]
    if not args.skip_reference:
        impls.append(("pytorch_chunked", gated_delta_chunked))
    if fla_available():
        impls.append(("fla", gated_delta_chunked_fla))
    chunked = [time_chunked(name, fn, args) for name, fn in impls]
    decode = time_decode(args)
    step_sweep = sweep_step(args) if args.step_sweep else None

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
    print(f"{'':<16} {'eager (do_bench of one call)':^29} {'CUDA graph (per step)':^29}")
    print(f"{'impl':<16} {'us':>9} {'TB/s':>7} {'of copy':>11} {'us':>9} {'TB/s':>7} {'of copy':>11}")
    for row in decode:
        eager, graph = (
            f"{_fmt(row[p + 'us'], 9, 2)} {_fmt(row[p + 'tb_per_s'], 7, 2)} {_pct(row[p + 'fraction_of_copy_bandwidth'])}"  # noqa: E501
            for p in ("", "graph_")
        )
        print(f"{row['impl']:<16} {eager} {graph}")
        if row["error"]:
            print(f"    error: {row['error'][:200]}")
    if step_sweep:
        copy_graph_us = decode[0]["graph_us"]
        print("\ntriton step in a CUDA graph, per rows-per-program x warps")
        print(f"{'rows':>5} {'warps':>5} {'us':>9} {'TB/s':>7} {'of copy':>11}")
        for row in step_sweep:
            fraction = copy_graph_us / row["graph_us"] if copy_graph_us else None
            row["graph_fraction_of_copy_bandwidth"] = fraction
            print(f"{row['rows_per_program']:>5} {row['num_warps']:>5} {row['graph_us']:>9.2f} "
                  f"{row['graph_tb_per_s']:>7.2f} {_pct(fraction)}")  # fmt: skip

    import triton

    from atma_titan.kernels.backends import autotune_choices
    from atma_titan.kernels.gated_delta import triton_chunked as chunked_kernels

    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": vars(args) | {"out": None},
        "chunked": chunked,
        "decode": decode,
        "decode_graph_steps": GRAPH_STEPS,
        "decode_rotations": ROTATIONS,
        "step_sweep": step_sweep,
        "autotune_choices": autotune_choices(chunked_kernels),
    }
    write_json(result_path("gated_delta", args.out), result)


def _fmt(x, width: int, digits: int = 3) -> str:
    return f"{x:>{width}.{digits}f}" if x is not None else f"{'-':>{width}}"


def _pct(x, width: int = 11) -> str:
    return f"{x:>{width}.1%}" if x is not None else f"{'-':>{width}}"


if __name__ == "__main__":
    main()
