"""The paged Polar decode kernel against SDPA over a contiguous cache, on CUDA.

    python benchmarks/kernels/paged_decode.py [--shapes 32x32768,64x4096,8x65536,1x65536] [--page-sizes 16,256]
                                              [--runs 30] [--rounds 3] [--out PATH]

Kernel shape: 8 query / 2 KV heads, head_dim 128, bf16, one decode query per sequence, every sequence
at the full context (batch x context). Per shape and page size, in the same process:

- `paged`: `polar_decode_triton` over a paged cache whose block tables are a random permutation of the
  pages (shape-only split policy, CUDA-graph safe launch);
- `sdpa`: F.scaled_dot_product_attention of q (B, H, 1, D) against a contiguous k, v (B, Hkv, T, D)
  cache with enable_gqa=True, under each SDPA backend that takes it (flash, efficient, cuDNN); the
  fastest is the baseline;
- `copy`: a device copy of a tensor of the K/V byte size (HBM bandwidth; read + write bytes).

Timing: each contender is captured in a CUDA graph that calls it once on each of `copies` distinct
caches (copies chosen so one replay touches >= 512 MiB, several times the 50 MiB L2, so every call
reads cold data and launch overhead is excluded); a run is one replay timed with CUDA events, divided
by `copies`; a round's time is the median of --runs runs (after 3 warm-up replays), and every contender of
a shape is timed once per round in --rounds interleaved rounds, the median round reported. The copy is
launched eagerly instead (in a graph `copy_` becomes a memcpy node on a copy engine, ~2/3 of the kernel
copy's bandwidth; a copy this large has no launch overhead to hide). Bandwidth = K/V bytes read
(B * T * Hkv * D * 2 tensors * 2 bytes) / time; the copy also reports read + write bytes. Results go
to benchmarks/results/paged_decode-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository: atma_titan and benchmarks.common without an install

from atma_titan.kernels.polar import polar_decode_triton  # noqa: E402
from benchmarks.common import result_path, write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
KERNEL_SHAPES = "32x32768,64x4096,8x65536,1x65536"
COLD_BYTES = 512 * 2**20  # one graph replay reads at least this much, so calls find nothing in L2
WARMUP_REPLAYS = 3


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def graph_time_us(calls, runs: int, *, graph: bool = True) -> float:
    """Median over `runs` of one CUDA-graph replay of all `calls` (each once), per call, in microseconds.

    graph=False times the calls launched eagerly instead (for copies: in a graph `copy_` becomes a memcpy
    node, run by a copy engine at about 2/3 of the bandwidth a copy kernel reaches)."""
    for call in calls:  # compile outside the capture
        call()
    torch.cuda.synchronize()
    replay = None
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for call in calls:
                call()
        replay = cuda_graph.replay

    def run_all():
        if replay is not None:
            replay()
        else:
            for call in calls:
                call()

    for _ in range(WARMUP_REPLAYS):
        run_all()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_all()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def polar_params(device="cuda"):
    """Per-head parameters near their initial values (docs/model.md section 3), fp32 as the model keeps them."""
    gen = torch.Generator(device=device).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    return [
        -1.0 + 0.1 * randn(HEADS),
        2.0 + 0.1 * randn(HEADS),
        0.5 + 0.1 * randn(HEADS),
        -1.5 + 0.1 * randn(HEADS),
        0.1 * randn(HEADS, HEAD_DIM),
    ]


def paged_cache(batch: int, context: int, page_size: int, seed: int, dtype=torch.bfloat16):
    """A full paged cache for batch x context, pages in random order: (q, k_pages, v_pages, table, lens)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    max_blocks = -(-context // page_size)
    num_pages = batch * max_blocks
    shape = (num_pages, page_size, KV_HEADS, HEAD_DIM)
    k_pages = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    v_pages = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    perm = torch.randperm(num_pages, generator=gen, device="cuda")
    table = perm.reshape(batch, max_blocks).to(torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=dtype)
    return q, k_pages, v_pages, table, lens


def contiguous_cache(batch: int, context: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, generator=gen, device="cuda", dtype=dtype)
    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=gen, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    return q, k, v


def kv_bytes(batch: int, context: int, element_size: int = 2) -> int:
    return batch * context * KV_HEADS * HEAD_DIM * 2 * element_size


def copies_for(nbytes: int) -> int:
    return max(1, math.ceil(COLD_BYTES / nbytes))


def time_paged(batch, context, page_size, runs, *, num_splits=None, config=None) -> float:
    """Median microseconds of one paged decode call. `config` (BLOCK_N, warps, stages) calls the
    launcher directly (sweeps); otherwise the public entry point."""
    from atma_titan.kernels.polar import triton_decode

    params = polar_params()
    calls = []
    for i in range(copies_for(kv_bytes(batch, context))):
        cache = paged_cache(batch, context, page_size, seed=10 + i)
        if config is None:
            calls.append(lambda cache=cache: polar_decode_triton(*cache, *params, num_splits=num_splits))
        else:
            calls.append(
                lambda cache=cache: triton_decode.polar_decode_forward(
                    *cache, *params, 0, num_splits=num_splits, config=config
                )
            )
    us = graph_time_us(calls, runs)
    del calls
    torch.cuda.empty_cache()
    return us


SDPA_BACKENDS = ("flash", "efficient", "cudnn")


def time_sdpa(batch, context, runs, backend: str) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[backend]
    calls = []
    for i in range(copies_for(kv_bytes(batch, context))):
        q, k, v = contiguous_cache(batch, context, seed=20 + i)

        def call(q=q, k=k, v=v):
            with sdpa_kernel(which):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        calls.append(call)
    us = graph_time_us(calls, runs)
    del calls
    torch.cuda.empty_cache()
    return us


def time_copy(nbytes: int, runs: int) -> float:
    calls = []
    for _ in range(copies_for(nbytes)):
        src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16).normal_()
        dst = torch.empty_like(src)
        calls.append(lambda src=src, dst=dst: dst.copy_(src))
    us = graph_time_us(calls, runs, graph=False)
    del calls
    torch.cuda.empty_cache()
    return us


def check_paged(page_size: int) -> float:
    """Max |c - c_ref| of the kernel against the PyTorch reference (fp32) at 2 x 5000 (a sanity check)."""
    from atma_titan.kernels.polar import polar_decode_reference

    q, k_pages, v_pages, table, lens = paged_cache(2, 5000, page_size, seed=3)
    params = polar_params()
    c, _ = polar_decode_triton(q, k_pages, v_pages, table, lens, *params)
    up = [x.float() for x in (q, k_pages, v_pages)]
    c_ref, _ = polar_decode_reference(*up, table, lens, *params)
    return (c.float() - c_ref).abs().max().item()


def run_kernel(args) -> dict:
    from atma_titan.kernels.polar import triton_decode

    shapes = parse_shapes(args.shapes)
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    n_sms = triton_decode.sm_count(torch.device("cuda"))
    block_n = triton_decode.tile_config(torch.device("cuda"), HEAD_DIM, 2)[0]
    rows = []
    for batch, context in shapes:
        nbytes = kv_bytes(batch, context)
        # every contender once per round, rounds interleaved so a slow spell of the machine hits them all
        times: dict[str, list[float]] = {}
        errors: dict[str, str] = {}
        for _ in range(args.rounds):
            times.setdefault("copy", []).append(time_copy(nbytes, args.runs))
            for backend in SDPA_BACKENDS:
                if backend in errors:
                    continue
                try:
                    backend_us = time_sdpa(batch, context, args.runs, backend)
                except Exception as err:  # a backend that does not take this case
                    errors[backend] = f"{type(err).__name__}: {str(err)[:200]}"
                    torch.cuda.empty_cache()
                else:
                    times.setdefault(backend, []).append(backend_us)
            for page_size in page_sizes:
                times.setdefault(str(page_size), []).append(time_paged(batch, context, page_size, args.runs))
        us = {name: statistics.median(runs) for name, runs in times.items()}
        row = {"batch": batch, "context": context, "kv_bytes": nbytes, "copies": copies_for(nbytes)}
        row["copy"] = {"us": us["copy"], "read_tb_per_s": nbytes / us["copy"] / 1e6, "rounds_us": times["copy"]}
        row["copy"]["rw_tb_per_s"] = 2 * row["copy"]["read_tb_per_s"]
        row["sdpa"] = {
            backend: {"error": errors[backend]}
            if backend in errors
            else {"us": us[backend], "tb_per_s": nbytes / us[backend] / 1e6, "rounds_us": times[backend]}
            for backend in SDPA_BACKENDS
        }
        ok = {k: v for k, v in row["sdpa"].items() if "us" in v}
        best = min(ok, key=lambda k: ok[k]["us"]) if ok else None
        row["sdpa_best"] = best
        row["paged"] = {}
        for page_size in page_sizes:
            paged_us = us[str(page_size)]
            max_blocks = -(-context // page_size)
            splits, pps = triton_decode.decode_split(batch, KV_HEADS, max_blocks, page_size, n_sms, block_n=block_n)
            entry = {"us": paged_us, "tb_per_s": nbytes / paged_us / 1e6, "num_splits": splits, "pages_per_split": pps}
            entry["rounds_us"] = times[str(page_size)]
            if best:
                entry["x_sdpa"] = ok[best]["us"] / paged_us
            entry["x_copy_read"] = row["copy"]["us"] / paged_us
            row["paged"][str(page_size)] = entry
        rows.append(row)
        print_kernel_row(row)
    return {
        "rows": rows,
        "max_abs_error_vs_reference": {str(p): check_paged(p) for p in page_sizes},
        "tile_config": triton_decode.tile_config(torch.device("cuda"), HEAD_DIM, 2),
        "sms": n_sms,
    }


def print_kernel_header():
    print(
        f"{'shape':>9} {'page':>4} {'paged TB/s':>10} {'us':>8} {'splits':>6} {'SDPA TB/s':>9} {'(backend)':>11} "
        f"{'paged/SDPA':>10} {'copy rd TB/s':>12}"
    )


def print_kernel_row(row):
    best = row["sdpa_best"]
    sdpa = row["sdpa"][best]["tb_per_s"] if best else float("nan")
    for page, entry in row["paged"].items():
        print(
            f"{row['batch']:>3}x{row['context'] // 1024:>4}K {page:>4} {entry['tb_per_s']:>10.2f} {entry['us']:>8.1f} "
            f"{entry['num_splits']:>6} {sdpa:>9.2f} {'(' + str(best) + ')':>11} "
            f"{entry.get('x_sdpa', float('nan')):>10.2f} "
            f"{row['copy']['read_tb_per_s']:>12.2f}"
        )


def add_args(parser):
    parser.add_argument("--shapes", default=KERNEL_SHAPES, help="batch x context list, e.g. 32x32768,1x65536")
    parser.add_argument("--page-sizes", default="16,256")
    parser.add_argument("--runs", type=int, default=30, help="replays per median")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median round is reported")
    parser.add_argument("--out", default=None, help="a results folder or a .json file")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")

    import triton

    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "dtype": "bfloat16",
        "args": vars(args),
        "timing": "median of --runs CUDA-graph replays (CUDA events), each calling the op once on each of "
        "`copies` distinct caches (>= 512 MiB per replay, cold L2); time per call; the median of --rounds "
        "interleaved rounds (rounds_us)",
    }
    print_kernel_header()
    record["kernel"] = run_kernel(args)
    write_json(result_path("paged_decode", args.out), record)


if __name__ == "__main__":
    main()
