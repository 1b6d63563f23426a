"""Shared memory and registers of every Triton kernel config the model launches, for A100, L4 and H100/H200.

    python benchmarks/kernels/kernel_resources.py [--flavor atma_370m] [--seq-len 2048] [--archs 80,89,90]
                                                  [--jobs 2] [--out benchmarks/results/]

Needs no GPU. The host launchers of the Polar attention (forward, backward, paged decode), gated
delta memory (chunked forward / backward, decode step), LM-head cross-entropy, MLP GLU backward and Muon
kernels are called at the flavor's shapes with tensors on the meta device (bf16 activations, fp32 gates
and states, as the model passes them) and their launches recorded instead of run; every config of each kernel's list
(the autotune list, the decode tile candidates, or the one fixed config) is then compiled ahead of time
for each compute capability (`atma_titan.kernels.resources`): shared memory per block from the
compiler, registers and spill stack bytes per thread from the cubin. A config fits a target when its
shared memory is within the target's opt-in limit per block (sm_80 166,912 B, sm_89 101,376 B, sm_90
232,448 B) and its registers within 64K per block. The ATMA_TRITON_AUTOTUNE=0 choice on a target is
the first config of the list that fits it (what the launch-time pruning runs there). Prints one line
per config and a summary per kernel, and writes the JSON (Triton version, shapes, limits, every
config's numbers).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.kernels import resources  # noqa: E402
from benchmarks.common import result_path, write_json  # noqa: E402

DEFAULT_ARCHS = (80, 89, 90)
DECODE_PAGE_SIZE = 16  # the inference cache's default
DECODE_CONTEXT = 4096


@dataclasses.dataclass
class Row:
    """One config of a kernel: its label, the recorded launch it compiles and the triton.Config (None: the
    launch's own options)."""

    config: str
    launch: resources.Launch
    tune: object | None = None

    def compile(self, arch: int) -> resources.KernelResources:
        if self.tune is not None:
            return resources.config_resources(self.launch.fn, self.launch.args, self.tune, arch)
        options = self.launch.options
        return resources.compile_config(
            self.launch.fn,
            self.launch.args,
            arch=arch,
            num_warps=options.get("num_warps", 4),
            num_stages=options.get("num_stages", 3),
            maxnreg=options.get("maxnreg"),
        )


@dataclasses.dataclass
class Case:
    """One kernel as the model launches it, with its configs in order of preference."""

    kernel: str
    rows: list[Row]
    note: str = ""
    archs: tuple[int, ...] | None = None  # the compute capabilities it runs on (None: every one)

    def runs_on(self, arch: int) -> bool:
        return self.archs is None or arch in self.archs


def model_shapes(flavor: str) -> dict:
    from atma_titan.models.flavors import FLAVORS

    args = FLAVORS[flavor]
    return {
        "flavor": flavor,
        "heads": args.n_heads,
        "kv_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        # the memory branch repeats k, v to every query head (models/memory.py): Dk = Dv = head_dim
        "memory_heads": args.n_heads,
        "memory_key_dim": args.head_dim,
        "memory_value_dim": args.head_dim,
        "window": args.window,
    }


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _tuned_rows(launch: resources.Launch) -> list[Row]:
    configs = getattr(launch.kernel, "configs", None)
    if not configs:
        options = ", ".join(f"{k}={v}" for k, v in launch.options.items()) or "defaults"
        return [Row(options, launch)]
    return [Row(_config_label(c), launch, c) for c in configs]


def _config_label(config) -> str:
    values = ", ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{values}, warps={config.num_warps}, stages={config.num_stages}"


def polar_cases(shapes: dict, seq_len: int) -> list[Case]:
    """The Polar kernels as sm_80 and sm_89 launch them, and as Hopper (sm_90) does: the forward, dq and dk/dv
    kernels with the tiles they loop over moved by the copy engine (tensor descriptors)."""
    from atma_titan.kernels.polar import triton_attention as attention

    h, hkv, d = shapes["heads"], shapes["kv_heads"], shapes["head_dim"]
    q, k, v = _meta(1, seq_len, h, d), _meta(1, seq_len, hkv, d), _meta(1, seq_len, hkv, d)
    params = [_meta(h, dtype=torch.float32) for _ in range(4)] + [_meta(h, d, dtype=torch.float32)]
    names = ["polar_fwd_kernel", "polar_bwd_preamble_kernel", "polar_bwd_dq_kernel", "polar_bwd_dkdv_kernel"]
    with resources.recorded_launches(attention, names) as launches:
        c, mag, lse, n_eff, s_norm = attention.polar_forward(q, k, v, *params, window=shapes["window"])
        attention.polar_backward(c, mag, q, k, v, *params, c, lse, n_eff, s_norm, window=shapes["window"])
    labels = {"polar_fwd_kernel": "polar.fwd", "polar_bwd_preamble_kernel": "polar.bwd_preamble"}
    labels |= {"polar_bwd_dq_kernel": "polar.bwd_dq", "polar_bwd_dkdv_kernel": "polar.bwd_dkdv"}
    before_hopper = tuple(a for a in resources.ARCH_LIMITS if a < 90)
    cases = []
    for launch in launches:
        if "TMA" not in launch.args:  # the preamble: one kernel everywhere
            cases.append(Case(labels[launch.name], _tuned_rows(launch)))
            continue
        cases.append(Case(labels[launch.name], _tuned_rows(launch), archs=before_hopper))
        args = {**launch.args, "TMA": True}
        # each descriptor argument (K_DESC, ...) describes the tensor argument of its name (K, ...)
        args |= {name: attention._descriptor(args[name.removesuffix("_DESC")])
                 for name in attention._DESCRIPTOR_ROWS if name in args}  # fmt: skip
        hopper = dataclasses.replace(launch, args=args)
        cases.append(Case(labels[launch.name], _tuned_rows(hopper), "tiles by the copy engine", archs=(90,)))
    return cases


def decode_cases(shapes: dict) -> list[Case]:
    from atma_titan.kernels.polar import triton_decode as decode

    h, hkv, d = shapes["heads"], shapes["kv_heads"], shapes["head_dim"]
    max_blocks = DECODE_CONTEXT // DECODE_PAGE_SIZE
    pages = _meta(max_blocks, DECODE_PAGE_SIZE, hkv, d)
    table = _meta(1, max_blocks, dtype=torch.int32)
    lens = _meta(1, dtype=torch.int32)
    params = [_meta(h, dtype=torch.float32) for _ in range(4)] + [_meta(h, d, dtype=torch.float32)]
    cases = []
    # one split per SM group (the usual launch), and >= LONG_MERGE_SPLITS splits (the capped-register merge)
    for label, splits in (("polar.decode", None), ("polar.decode_long_merge", decode.LONG_MERGE_SPLITS)):
        rows = []
        for tile in decode.CUDA_CONFIGS:
            with resources.recorded_launches(decode, ["polar_decode_kernel"]) as launches:
                decode.polar_decode_forward(
                    _meta(1, h, d), pages, pages, table, lens, *params, window=shapes["window"],
                    num_splits=splits, config=tile,
                )  # fmt: skip
            rows.append(Row(f"BLOCK_N={tile[0]}, warps={tile[1]}, stages={tile[2]}", launches[0]))
        note = f"page_size={DECODE_PAGE_SIZE}, batch 1, {DECODE_CONTEXT} keys" + (
            f", {splits} splits" if splits else ""
        )
        cases.append(Case(label, rows, note))
    return cases


def gated_delta_cases(shapes: dict, seq_len: int) -> list[Case]:
    from atma_titan.kernels.gated_delta import triton_chunked as chunked
    from atma_titan.kernels.gated_delta import triton_step as step

    h, dk, dv = shapes["memory_heads"], shapes["memory_key_dim"], shapes["memory_value_dim"]
    q, k, v = _meta(1, seq_len, h, dk), _meta(1, seq_len, h, dk), _meta(1, seq_len, h, dv)
    gates = [_meta(1, seq_len, h, dtype=torch.float32) for _ in range(2)]
    state = _meta(1, h, dv, dk, dtype=torch.float32)
    names = ["_prepare_kernel", "_state_fwd_kernel", "_output_kernel", "_dv_local_kernel", "_state_bwd_kernel"]
    names += ["_grad_transform_kernel", "_grad_output_kernel"]
    with resources.recorded_launches(chunked, names) as training:
        _, _, workspaces = chunked.chunk_forward(q, k, v, *gates, None, True, keep_workspaces=True)
        chunked.chunk_backward(q, k, v, *gates, workspaces, _meta(1, seq_len, h, dv), state, True)
    with resources.recorded_launches(chunked, names) as prefill:
        chunked.chunk_forward(q, k, v, *gates, None, True)  # no gradients: nothing kept for a backward
        chunked.chunk_forward(q, k, v, *gates, state, True)  # a prefill chunk continues from the cache's state
    with resources.recorded_launches(step, ["_step_kernel"]) as decoding:
        pool = _meta(4, h, dv, dk, dtype=torch.float32)
        slots = _meta(4, dtype=torch.int64)
        step.step_inplace(
            pool, slots, _meta(4, h, dk), _meta(4, h, dk), _meta(4, h, dv), *[_meta(4, h, dtype=torch.float32)] * 2
        )
    cases, seen = [], set()
    for launch in [*training, *prefill, *decoding]:
        label = "gated_delta." + launch.name.strip("_").removesuffix("_kernel")
        if launch.name == "_prepare_kernel":
            label += "" if launch.args["STORE_INVERSE"] else " (no gradients)"
        if launch.name == "_state_fwd_kernel" and launch.args["HAS_INITIAL"]:
            label += " (initial state)"
        if label not in seen:
            seen.add(label)
            cases.append(Case(label, _tuned_rows(launch)))
    return cases


def softcap_ce_cases(flavor: str) -> list[Case]:
    """The LM head's cross-entropy kernels on one default chunk of bf16 logits (models/loss.py)."""
    from atma_titan.kernels.softcap_ce import triton_ce
    from atma_titan.models.flavors import FLAVORS
    from atma_titan.models.loss import DEFAULT_CHUNK_MIB, chunk_tokens_for

    vocab = FLAVORS[flavor].vocab_size
    rows = chunk_tokens_for(vocab, DEFAULT_CHUNK_MIB)
    logits, targets = _meta(rows, vocab), _meta(rows, dtype=torch.int64)
    lse, scale = _meta(rows, dtype=torch.float32), _meta(rows, dtype=torch.float32)
    with resources.recorded_launches(triton_ce, ["_ce_rows_kernel", "_ce_grad_kernel"]) as launches:
        triton_ce.softcap_ce_forward(logits, targets, scale, 15.0)
        triton_ce.softcap_ce_backward_(logits, lse, targets, scale, 15.0, bias_grad=True)
    note = f"{rows} tokens x vocab {vocab:,} (one {DEFAULT_CHUNK_MIB:g} MiB chunk)"
    return [Case("softcap_ce." + launch.name.removeprefix("_ce_").removesuffix("_kernel"), _tuned_rows(launch), note)
            for launch in launches]  # fmt: skip


def muon_update_cases(flavor: str) -> list[Case]:
    """Muon's element-wise kernels over the flavor's block matrices (optim.py, kernels/muon_update)."""
    from atma_titan.kernels.muon_update import triton_muon
    from atma_titan.models import ATMA
    from atma_titan.models.flavors import FLAVORS
    from atma_titan.optim import split_parameters

    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in split_parameters(ATMA(FLAVORS[flavor]))["matrix"]]
    fp32 = [_meta(*s, dtype=torch.float32) for s in shapes]
    bf16 = [_meta(*s) for s in shapes]
    scalar = _meta(1, dtype=torch.float32)[0]  # the clip's coefficient, the step's skip flag: the trainer's variant
    with resources.recorded_launches(triton_muon, ["_stage_kernel", "_apply_kernel"]) as launches:
        triton_muon.stage_momentum_(fp32, fp32, bf16, 0.95, True, grad_scale=scalar, skip=scalar)
        triton_muon.apply_updates_(fp32, bf16, 0.9998, [-0.02] * len(shapes), skip=scalar)
    note = f"{len(shapes)} matrices, {sum(s[0] * s[1] for s in shapes):,} elements"
    return [Case("muon." + launch.name.strip("_").removesuffix("_kernel"), _tuned_rows(launch), note)
            for launch in launches]  # fmt: skip


def glu_cases(flavor: str, seq_len: int) -> list[Case]:
    """The MLP's GLU backward over one recipe micro-batch of 16 sequences (models/layers.py, kernels/glu)."""
    from atma_titan.kernels.glu import triton_glu
    from atma_titan.models.flavors import FLAVORS

    args, tokens = FLAVORS[flavor], 16 * seq_len
    fc, dh, bias = _meta(tokens, 2 * args.mlp_hidden), _meta(tokens, args.mlp_hidden), _meta(2 * args.mlp_hidden)
    with resources.recorded_launches(triton_glu, ["_glu_bwd_kernel"]) as launches:
        triton_glu.glu_backward(fc, dh, args.mlp, bias)
    note = f"{tokens:,} tokens x hidden {args.mlp_hidden:,} ({args.mlp})"
    return [Case("glu.bwd", _tuned_rows(launch), note) for launch in launches]


def short_conv_cases(flavor: str, seq_len: int) -> list[Case]:
    """The LFM2 conv block's backward pass over one recipe micro-batch of 16 sequences (models/conv.py,
    kernels/short_conv)."""
    from atma_titan.kernels.short_conv import triton_short_conv
    from atma_titan.models.flavors import FLAVORS

    args = FLAVORS[flavor]
    u, do = _meta(16, seq_len, 3 * args.d_model), _meta(16, seq_len, args.d_model)
    weight, bias = _meta(args.d_model, args.conv_kernel), _meta(3 * args.d_model)
    with resources.recorded_launches(triton_short_conv, ["_gated_conv_bwd_kernel"]) as launches:
        triton_short_conv.gated_conv_backward(u, do, weight, bias)
    note = f"16 x {seq_len:,} tokens x {args.d_model:,} channels, kernel {args.conv_kernel}"
    return [Case("short_conv.bwd", _tuned_rows(launch), note) for launch in launches]


def model_cases(flavor: str = "atma_370m", seq_len: int = 2048) -> list[Case]:
    """Every kernel the flavor's model and its training launch (training, prefill and decode), at its shapes."""
    shapes = model_shapes(flavor)
    return [
        *polar_cases(shapes, seq_len),
        *decode_cases(shapes),
        *gated_delta_cases(shapes, seq_len),
        *softcap_ce_cases(flavor),
        *muon_update_cases(flavor),
        *glu_cases(flavor, seq_len),
        *short_conv_cases(flavor, seq_len),
    ]


# ----------------------------------------------------------------------------------------------
# Compiling (in worker processes: each compile is single-threaded)
# ----------------------------------------------------------------------------------------------

_CASES: dict[tuple, list[Case]] = {}


def _compile_job(flavor: str, seq_len: int, case: int, row: int, arch: int) -> tuple[dict, float]:
    key = (flavor, seq_len)
    if key not in _CASES:
        _CASES[key] = model_cases(flavor, seq_len)
    start = time.perf_counter()
    found = _CASES[key][case].rows[row].compile(arch)
    return dataclasses.asdict(found), time.perf_counter() - start


def all_configs(cases: list[Case], archs) -> list[tuple[int, int, int]]:
    """Every (case, row, arch) compile job."""
    return [
        (c, r, arch)
        for c, case in enumerate(cases)
        for arch in filter(case.runs_on, archs)
        for r in range(len(case.rows))
    ]


def measure(cases: list[Case], work, flavor: str, seq_len: int, jobs: int, progress: bool = True) -> dict:
    """{(case, row, arch): (resources dict, compile seconds)} for the (case, row, arch) jobs `work`, in `jobs`
    processes (cases as model_cases(flavor, seq_len) builds them)."""
    if jobs <= 1:
        _CASES[(flavor, seq_len)] = cases
        return {w: _compile_job(flavor, seq_len, *w) for w in work}
    import multiprocessing

    # spawned, not forked: the parent has torch's and Triton's threads running
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_compile_job, flavor, seq_len, *w): w for w in work}
        found = {}
        for done, future in enumerate(as_completed(futures), 1):
            c, r, arch = futures[future]
            found[(c, r, arch)] = future.result()
            if progress:
                print(f"[{done}/{len(work)}] {cases[c].kernel} {cases[c].rows[r].config} sm_{arch}", flush=True)
        return found


def report(cases: list[Case], found: dict, archs) -> list[dict]:
    kernels = []
    for c, case in enumerate(cases):
        configs = []
        for r, row in enumerate(case.rows):
            per_arch = {}
            for arch in filter(case.runs_on, archs):
                numbers, _ = found[(c, r, arch)]
                per_arch[f"sm_{arch}"] = {**numbers, "fits": resources.KernelResources(**numbers).fits(arch)}
            configs.append({"config": row.config, "targets": per_arch})
        summary = {}
        for arch in filter(case.runs_on, archs):
            target = f"sm_{arch}"
            fitting = [cfg for cfg in configs if cfg["targets"][target]["fits"]]
            choice = fitting[0] if fitting else None
            summary[target] = {
                "fitting": len(fitting),
                "of": len(configs),
                "autotune0_choice": None
                if choice is None
                else {
                    "config": choice["config"],
                    **{k: choice["targets"][target][k] for k in ("shared", "registers", "stack")},
                },
            }
        kernels.append({"kernel": case.kernel, "note": case.note, "configs": configs, "summary": summary})
    return kernels


def print_table(kernels: list[dict], archs) -> None:
    head = "".join(f" | sm_{a}: {'smem':>7} {'regs':>4} {'stack':>5} fit" for a in archs)
    print(f"{'kernel':<38} {'config':<52}{head}")
    for kernel in kernels:
        for cfg in kernel["configs"]:
            cells = ""
            for arch in archs:
                t = cfg["targets"].get(f"sm_{arch}")
                if t is None:  # a kernel that does not run on this target
                    cells += f" | {'':6}{'-':>7} {'-':>4} {'-':>5} {'-':>3}"
                    continue
                fit = "yes" if t["fits"] else "NO"
                cells += f" | {'':6}{t['shared']:>7} {t['registers'] or '?':>4} {t['stack'] or 0:>5} {fit:>3}"
            print(f"{kernel['kernel']:<38} {cfg['config']:<52}{cells}")
    print("\nsummary: configs fitting each target; the ATMA_TRITON_AUTOTUNE=0 choice (the first that fits)")
    for kernel in kernels:
        parts = []
        for arch in archs:
            s = kernel["summary"].get(f"sm_{arch}")
            if s is None:
                continue
            choice = s["autotune0_choice"]
            pick = (
                "none"
                if choice is None
                else f"{choice['shared']:,} B smem, {choice['registers']} regs, {choice['stack']} B spill"
            )
            parts.append(f"sm_{arch} {s['fitting']}/{s['of']} ({pick})")
        print(f"  {kernel['kernel']:<38} " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="atma_370m")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--archs", default=",".join(str(a) for a in DEFAULT_ARCHS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--out", type=Path, default=None, help="a results folder or a .json file")
    args = parser.parse_args()
    import triton

    archs = [int(a) for a in args.archs.split(",")]
    unknown = [a for a in archs if a not in resources.ARCH_LIMITS]
    if unknown:
        parser.error(f"--archs {unknown}: allowed {sorted(resources.ARCH_LIMITS)}")
    cases = model_cases(args.flavor, args.seq_len)
    start = time.perf_counter()
    found = measure(cases, all_configs(cases, archs), args.flavor, args.seq_len, args.jobs)
    kernels = report(cases, found, archs)
    print_table(kernels, archs)
    result = {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "shapes": {**model_shapes(args.flavor), "seq_len": args.seq_len, "dtype": "bfloat16"},
        "limits": {f"sm_{a}": dataclasses.asdict(resources.ARCH_LIMITS[a]) for a in archs},
        "kernels": kernels,
        "compile_wall_s": round(time.perf_counter() - start, 1),
    }
    print(f"\n{result['compile_wall_s']} s of compiles")
    write_json(result_path("kernel_resources", args.out, device="sm" + "_".join(map(str, archs))), result)


if __name__ == "__main__":
    main()
