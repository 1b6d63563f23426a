"""Every Triton kernel the 370M model launches has a config that fits an A100, an L4 and an H100/H200.

Compiled ahead of time on the CPU (atma_titan.kernels.resources), at the model's shapes as
benchmarks/kernels/kernel_resources.py records them from the real launchers; the full table is that script's
JSON. Only what a claim needs is compiled: per kernel and target the configs in order up to the
first that fits (usually the first alone), and Triton caches the compiles on disk.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGETS = (80, 89, 90)  # A100, L4, H100 / H200

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles the GPU configs"),
]


@functools.lru_cache(maxsize=None)
def _compiles_here() -> str | None:
    """None where Triton compiles for CUDA targets on this machine, else why not."""
    try:
        import triton
        import triton.language as tl

        from atma_titan.kernels import resources

        @triton.jit
        def _probe(x_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)

        import torch

        x = torch.empty(0, device="meta")
        resources.compile_config(_probe, {"x_ptr": x, "BLOCK": 32}, arch=89, num_warps=1, num_stages=1)
    except Exception as err:  # noqa: BLE001 - any failure means: cannot compile here
        return f"{type(err).__name__}: {err}"
    return None


@pytest.fixture(scope="module")
def compiler():
    reason = _compiles_here()
    if reason:
        pytest.skip(f"Triton cannot compile for CUDA targets here: {reason}")
    from atma_titan.kernels import resources

    return resources


@functools.lru_cache(maxsize=None)
def _bench():
    # imported by name from benchmarks/kernels/ (on sys.path from here on), so that its spawned compile workers
    # find it too
    sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))
    import kernel_resources

    return kernel_resources


@functools.lru_cache(maxsize=None)
def _cases():
    return _bench().model_cases("atma_370m", 2048)


def test_model_launches_cover_every_kernel():
    """The recorded launches include every Triton kernel of the model at the 370M shapes."""
    names = {case.kernel for case in _cases()}
    assert {"polar.fwd", "polar.bwd_dq", "polar.bwd_dkdv", "polar.bwd_preamble", "polar.decode"} <= names
    gated_delta = ("prepare", "state_fwd", "output", "dv_local", "state_bwd", "grad_transform", "grad_output")
    assert {f"gated_delta.{k}" for k in gated_delta} <= names
    assert "gated_delta.step" in names
    assert {"softcap_ce.rows", "softcap_ce.grad"} <= names
    assert {"muon.stage", "muon.apply"} <= names
    assert {"glu.bwd", "short_conv.bwd"} <= names
    fwd = next(case for case in _cases() if case.kernel == "polar.fwd")
    assert fwd.rows[0].launch.args["HEAD_DIM"] == 128 and fwd.rows[0].launch.args["GROUP"] == 4
    assert len(fwd.rows) == len(fwd.rows[0].launch.kernel.configs) > 1  # the whole autotune list


@pytest.mark.slow
def test_every_kernel_has_a_config_that_fits_each_target(compiler):
    """On an L4 (sm_89, the least shared memory) and an H100/H200 (sm_90) some config of each kernel's list
    fits, and on the L4 the first config does, so ATMA_TRITON_AUTOTUNE=0 runs the same config there as on
    an H200. The first configs are compiled in two processes (cold: ~30 compiles of 1-5 s; Triton's disk
    cache makes a rerun take seconds); later ones only where a first one does not fit."""
    bench, cases = _bench(), _cases()
    # sm_80 is left to benchmarks/kernels/kernel_resources.py: Triton compiles it through the same Ampere path
    # as sm_89 (the same shared memory per config: benchmarks/results/kernel_resources-sm80_89_90-2026-12-07.json),
    # with a larger limit.
    targets = [arch for arch in TARGETS if arch != 80]
    work = [(c, 0, arch) for c, case in enumerate(cases) for arch in targets if case.runs_on(arch)]
    found = bench.measure(cases, work, "atma_370m", 2048, jobs=min(2, os.cpu_count() or 1), progress=False)
    missing, not_first = [], []
    for c, case in enumerate(cases):
        for arch in filter(case.runs_on, targets):
            if compiler.KernelResources(**found[(c, 0, arch)][0]).fits(arch):
                continue
            later = next((r for r, row in enumerate(case.rows[1:], 1) if row.compile(arch).fits(arch)), None)
            (missing if later is None else not_first).append(f"{case.kernel} on sm_{arch}")
    assert not missing, f"no config fits: {missing}"
    assert not [m for m in not_first if m.endswith("sm_89")], f"the first config does not fit: {not_first}"


def test_pruning_drops_configs_over_the_device_limit(compiler):
    """FittingPrune keeps only configs whose compiled shared memory fits the limit, in order; with
    `single` (ATMA_TRITON_AUTOTUNE=0) the first that fits; none fitting is an error naming the needs."""
    import triton
    import triton.language as tl

    @triton.jit
    def _staged_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        # a pipelined loop of dots: shared memory grows with BLOCK and num_stages
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK, BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            a = tl.load(x_ptr + (start + offs)[:, None] * BLOCK + offs[None, :])
            acc = tl.dot(a, a, acc)
        tl.store(y_ptr + offs[:, None] * BLOCK + offs[None, :], acc)

    import torch

    x = torch.empty(0, dtype=torch.bfloat16, device="meta")
    y = torch.empty(0, dtype=torch.float32, device="meta")
    configs = [triton.Config({"BLOCK": 128}, num_warps=4, num_stages=4), triton.Config({"BLOCK": 32}, num_warps=4)]

    def shared_bytes(config, named_args, kwargs):
        return compiler.config_resources(_staged_copy, {**named_args, **kwargs}, config, 89).shared

    big, small = (shared_bytes(c, {"x_ptr": x, "y_ptr": y, "n": 4096}, {}) for c in configs)
    assert big > small
    named = {"x_ptr": x, "y_ptr": y, "n": 4096}
    limit = (big + small) // 2
    prune = compiler.FittingPrune(_staged_copy, shared_bytes=shared_bytes, limit=limit)
    assert prune(configs, named) == [configs[1]]
    assert compiler.FittingPrune(_staged_copy, shared_bytes=shared_bytes, limit=big)(configs, named) == configs
    single = compiler.FittingPrune(_staged_copy, single=True, shared_bytes=shared_bytes, limit=big)
    assert single(configs, named) == [configs[0]]
    with pytest.raises(RuntimeError, match="no kernel config fits"):
        compiler.FittingPrune(_staged_copy, shared_bytes=shared_bytes, limit=small - 1)(configs, named)
    # the shape pruning of a kernel (pre_prune) runs first
    only_small = compiler.FittingPrune(
        _staged_copy, shared_bytes=shared_bytes, limit=big, pre_prune=lambda cs, named, **kw: cs[1:]
    )
    assert only_small(configs, named) == [configs[1]]


def test_resources_fit_checks_shared_memory_and_registers(compiler):
    resources = compiler
    l4 = resources.ARCH_LIMITS[89].shared_per_block_optin
    assert resources.KernelResources(l4, 128, 0, 8).fits(89)
    assert not resources.KernelResources(l4 + 1, 128, 0, 8).fits(89)
    over_l4 = resources.KernelResources(l4 + 1, 128, 0, 8)
    assert over_l4.fits(80) and over_l4.fits(90)
    assert not resources.KernelResources(1024, 255, 0, 16).fits(90)  # 255 x 512 threads > 64K registers
    assert [resources.ARCH_LIMITS[a].shared_per_block_optin for a in TARGETS] == [166_912, 101_376, 232_448]


def test_autotuned_kernels_prune_by_fit(compiler):
    """Each autotuned kernel of the model has the full config list (also with ATMA_TRITON_AUTOTUNE=0) and the
    fitting prune; the gated delta kernels keep their Dv prune before it."""
    from atma_titan.kernels.gated_delta import triton_chunked as chunked
    from atma_titan.kernels.polar import triton_attention as attention

    for kernel, configs in (
        (attention.polar_fwd_kernel, attention.FWD_CONFIGS),
        (attention.polar_bwd_dq_kernel, attention.DQ_CONFIGS),
        (attention.polar_bwd_dkdv_kernel, attention.DKDV_CONFIGS),
        (chunked._state_fwd_kernel, chunked.SEQUENTIAL_CONFIGS),
        (chunked._output_kernel, chunked.PARALLEL_CONFIGS),
        (chunked._grad_transform_kernel, chunked.GRAD_CONFIGS),
        (chunked._grad_output_kernel, chunked.GRAD_CONFIGS),
    ):
        assert kernel.configs == configs and len(configs) > 1
        assert isinstance(kernel.early_config_prune, compiler.FittingPrune)
        assert kernel.early_config_prune.single == (not attention.AUTOTUNE)
    assert chunked._output_kernel.early_config_prune.pre_prune is chunked._prune_wide_blocks


# ---------------------------------------------------------------------------------------------
# GPU (skipped without CUDA): the launch-time pruning with Triton's own compiles, under a smaller limit
# ---------------------------------------------------------------------------------------------


def _needs_cuda():
    import torch

    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@_needs_cuda()
@pytest.mark.gpu
@pytest.mark.slow
def test_attention_launch_runs_only_configs_within_the_limit(monkeypatch):
    """With the device's limit lowered to 140,000 B (between the H200's compiled configs), the autotuned
    attention kernels compile every config for the launch, run none above the limit, and stay correct."""
    import torch
    from helpers import make_inputs

    from atma_titan.kernels import resources
    from atma_titan.kernels.polar import polar_attention_naive, polar_attention_triton
    from atma_titan.kernels.polar import triton_attention as attention

    limit = 140_000
    monkeypatch.setattr(resources, "device_shared_limit", lambda device: limit)
    measured: dict[tuple[str, object], int] = {}
    real = resources.warmup_shared

    def spy(fn, args, kwargs, config=None):
        measured[(fn.__name__, config)] = shared = real(fn, args, kwargs, config)
        return shared

    monkeypatch.setattr(resources, "warmup_shared", spy)
    kernels = (attention.polar_fwd_kernel, attention.polar_bwd_dq_kernel, attention.polar_bwd_dkdv_kernel)
    for kernel in kernels:
        monkeypatch.setattr(kernel, "cache", {})
    inputs = [x.detach().to("cuda", torch.bfloat16).requires_grad_() for x in make_inputs(1, 256, 256, 8, 2, 128)]
    c, mag = polar_attention_triton(*inputs)
    (c.float().sum() + mag.float().sum()).backward()
    c_ref, _ = polar_attention_naive(*(x.detach().double() for x in inputs))
    torch.testing.assert_close(c.double(), c_ref, rtol=3e-2, atol=3e-2)
    for kernel in kernels:
        name = kernel.fn.__name__
        sizes = {config: shared for (fn, config), shared in measured.items() if fn == name}
        assert kernel.best_config in sizes and sizes[kernel.best_config] <= limit, name
        timed = getattr(kernel, "configs_timings", None) or {}
        assert all(sizes[config] <= limit for config in timed), name


@_needs_cuda()
@pytest.mark.gpu
def test_decode_falls_back_to_a_tile_within_the_limit(monkeypatch):
    """With the device's limit just below the first tile's compiled shared memory, the decode launch takes
    the next tile (the sizes depend on the GPU and the dtype, so the limit is set from the first launch)."""
    import torch
    from paged_decode_inputs import make_paged

    from atma_titan.kernels import resources
    from atma_titan.kernels.polar import polar_decode_reference, polar_decode_triton
    from atma_titan.kernels.polar import triton_decode as decode

    sizes, real = [], resources.warmup_shared
    monkeypatch.setattr(resources, "warmup_shared", lambda *a, **k: sizes.append(real(*a, **k)) or sizes[-1])
    inputs, _ = make_paged([1, 100, 2000], 8, 2, 128, 16, 130, seed=53, dtype=torch.float32)
    inputs = [x.cuda() for x in inputs]
    limit = {"bytes": 1 << 30}
    monkeypatch.setattr(resources, "device_shared_limit", lambda device: limit["bytes"])
    for expected in (decode.CUDA_CONFIGS[0], decode.CUDA_CONFIGS[1]):
        monkeypatch.setattr(decode, "_TILE_CHOICE", {})
        sizes.clear()
        c, _ = polar_decode_triton(*inputs)
        assert list(decode._TILE_CHOICE.values()) == [expected]
        limit["bytes"] = sizes[0] - 1  # the next launch: the first tile no longer fits
    assert sizes[-1] <= limit["bytes"]
    c_ref, _ = polar_decode_reference(*(x.double() if x.is_floating_point() else x for x in inputs))
    torch.testing.assert_close(c.double(), c_ref, rtol=1e-4, atol=2e-5)
