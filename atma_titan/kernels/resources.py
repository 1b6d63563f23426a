"""What one compiled Triton kernel config needs from a GPU, and whether a GPU has it.

Two ways to compile a config without launching it, both giving the exact numbers of the compiled code
(never an estimate from tile sizes):

- ahead of time for any target (`compile_config`, no GPU needed: the benchmark and the tests compile
  for sm_80, sm_89 and sm_90 on a CPU machine): shared memory from the compiler's metadata, registers
  and spill (stack) bytes per thread from the cubin through the cuobjdump that ships with Triton;
- for the launch at hand (`warmup_shared`): the kernel's own JIT compile with the launch's arguments
  and specialisation, which the launch then reuses (nothing is compiled twice).

`autotune` is `triton.autotune` with an `early_config_prune` (`FittingPrune`) that keeps only the
configs whose compiled shared memory fits the launch device's opt-in limit per block, so a GPU with
less shared memory than the one the lists were tuned on (an L4 against an H200) never tries a config
it cannot launch. `recorded_launches` captures the arguments a host launcher passes (on meta tensors),
for the ahead-of-time compiles. Kernel-agnostic: nothing here knows about models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ARCH_LIMITS",
    "ArchLimits",
    "FittingPrune",
    "KernelResources",
    "Launch",
    "autotune",
    "compile_config",
    "config_resources",
    "device_shared_limit",
    "first_fitting",
    "fitting_configs",
    "launch_signature",
    "recorded_launches",
    "warmup_shared",
]


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    """Per-block limits of one compute capability (CUDA programming guide, "Technical Specifications")."""

    arch: int  # compute capability as major * 10 + minor
    gpus: str
    shared_per_block_optin: int  # bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin
    registers_per_block: int = 65_536
    registers_per_thread: int = 255


# One row per compute capability the project runs on.
ARCH_LIMITS: dict[int, ArchLimits] = {
    limits.arch: limits
    for limits in (
        ArchLimits(80, "A100, A30", 166_912),  # 163 KiB
        ArchLimits(86, "A10, A40, RTX 30xx", 101_376),  # 99 KiB
        ArchLimits(89, "L4, L40S, RTX 40xx", 101_376),  # 99 KiB
        ArchLimits(90, "H100, H200", 232_448),  # 227 KiB
    )
}


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What one compiled config needs: per block shared memory, per thread registers and spill stack."""

    shared: int  # bytes per block
    registers: int | None  # per thread; None where the cubin could not be read
    stack: int | None  # bytes per thread of local memory (> 0: register spills)
    num_warps: int

    def fits(self, arch: int | ArchLimits) -> bool:
        """Whether a block of this config can be resident on a GPU of compute capability `arch`."""
        limits = arch if isinstance(arch, ArchLimits) else ARCH_LIMITS[arch]
        if self.shared > limits.shared_per_block_optin:
            return False
        if self.registers is None:
            return True
        # registers are allocated per thread in units of 8
        allocated = -(-self.registers // 8) * 8
        threads = self.num_warps * 32
        return self.registers <= limits.registers_per_thread and allocated * threads <= limits.registers_per_block


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compiles (no GPU)
# ----------------------------------------------------------------------------------------------

_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}


def launch_signature(fn, args: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any], tuple[str, ...]]:
    """(signature, constexprs, aligned) of a @triton.jit function `fn` for a launch with `args`, by name.

    A tensor (any device, `meta` included) stands for a pointer to its dtype, a TensorDescriptor for a
    descriptor of its block shape, a Python int for an i32 (i64 past 32 bits), a float for an fp32, a bool
    for an i1; constexpr parameters take their value.
    `aligned` names the arguments specialised as divisible by 16 the way a launch does it: every pointer
    (the caching allocator's blocks are 512-byte aligned) and every int that is a multiple of 16.
    """
    signature, constexprs, aligned = {}, {}, []
    constexpr_names = {fn.arg_names[i] for i in fn.constexprs}
    for name in fn.arg_names:
        if name not in args:
            raise KeyError(f"{fn.__name__}: no value for argument {name!r}")
        value = args[name]
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[value.dtype]
            aligned.append(name)
        elif type(value).__name__ == "TensorDescriptor":  # a host-side tensor descriptor (Hopper's copy engine)
            signature[name] = f"tensordesc<{_DTYPES[value.base.dtype]}[{','.join(map(str, value.block_shape))}]>"
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                aligned.append(name)
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name!r} = {value!r} is no tensor, int, float or bool")
    return signature, constexprs, tuple(aligned)


def _cuobjdump() -> Path:
    import triton.backends.nvidia as nvidia

    return Path(nvidia.__file__).parent / "bin" / "cuobjdump"


def _registers_and_stack(cubin: bytes) -> tuple[int | None, int | None]:
    """REG and STACK of the one kernel in `cubin`, from `cuobjdump -res-usage`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        try:
            usage = subprocess.run([str(_cuobjdump()), "-res-usage", file.name], capture_output=True, text=True)
        except OSError:  # pragma: no cover - a Triton build without the bundled binary
            return None, None
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    return (int(found.group(1)), int(found.group(2))) if found else (None, None)


def compile_config(
    fn,
    args: Mapping[str, Any],
    *,
    arch: int,
    num_warps: int,
    num_stages: int,
    maxnreg: int | None = None,
) -> KernelResources:
    """Compile the @triton.jit function `fn` (an autotuned kernel's `.fn`) ahead of time for compute
    capability `arch` with `args` (every argument by name, constexprs and config values included, see
    `launch_signature`; constexpr values must be hashable) and return its resources. Cached per process
    (per signature, constexprs and options), and by Triton on disk."""
    signature, constexprs, aligned = launch_signature(fn, args)
    return _compile(
        fn, tuple(signature.items()), tuple(constexprs.items()), aligned, arch, num_warps, num_stages, maxnreg
    )


@functools.lru_cache(maxsize=None)
def _compile(fn, signature, constexprs, aligned, arch, num_warps, num_stages, maxnreg) -> KernelResources:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    index = {name: i for i, name in enumerate(fn.arg_names)}
    # keys as (argument index,) tuples: the form both Triton 3.6 and 3.9 accept
    source = ASTSource(
        fn,
        dict(signature),
        constexprs={(index[name],): value for name, value in constexprs},
        attrs={(index[name],): [["tt.divisibility", 16]] for name in aligned},
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    registers, stack = _registers_and_stack(compiled.asm["cubin"])
    return KernelResources(int(compiled.metadata.shared), registers, stack, num_warps)


def config_resources(fn, args: Mapping[str, Any], config, arch: int) -> KernelResources:
    """`compile_config` for a `triton.Config`: its kwargs join `args`, its warps / stages / maxnreg the options
    (after its pre_hook, which may shape an argument as the launch would)."""
    args = {**args, **config.kwargs}
    if config.pre_hook is not None:
        config.pre_hook(args)
    return compile_config(
        fn,
        args,
        arch=arch,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        maxnreg=getattr(config, "maxnreg", None),
    )


# ----------------------------------------------------------------------------------------------
# The launch device, and compiles for the launch at hand
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_shared_limit(device: torch.device) -> int:
    """Opt-in shared memory per block of CUDA device `device` in bytes (what a kernel may ask for), from
    the device; the ARCH_LIMITS row of its compute capability where the property is missing."""
    props = _properties(_index(device))
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    if optin:
        return int(optin)
    limits = ARCH_LIMITS.get(props.major * 10 + props.minor)
    return limits.shared_per_block_optin if limits else 48 * 1024


def warmup_shared(fn, args: Sequence, kwargs: Mapping[str, Any], config=None) -> int:
    """Shared memory per block of the @triton.jit function `fn` compiled for this launch (positional
    `args`, `kwargs`, and `config`'s values and options) on the current CUDA device, without launching it.
    Triton's own compile for the launch: it is cached as the launch's, so the launch compiles nothing
    again."""
    options = config.all_kwargs() if config is not None else {}
    # The autotuner's prune hook also receives its own launch keywords (Triton 3.6: grid, warmup).
    kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    if config is not None and config.pre_hook is not None:  # e.g. a descriptor's block shape: part of the compile
        config.pre_hook({**dict(zip(fn.arg_names, args)), **kwargs, **options})
    kernel = fn.warmup(*args, grid=(1,), **kwargs, **options)
    if hasattr(kernel, "result"):  # Triton's async compile mode hands back a future
        kernel = kernel.result()
    return int(kernel.metadata.shared)


def fitting_configs(configs: Sequence, shared_bytes: Callable[[Any], int], limit: int, *, first_only: bool = False):
    """The configs (in order) whose compiled shared memory `shared_bytes(config)` is at most `limit`;
    only the first of them with `first_only`. A config that fails to compile does not fit. Raises
    RuntimeError when none fits, naming each config's need."""
    kept, needs = [], []
    for config in configs:
        try:
            shared = shared_bytes(config)
        except Exception as err:  # noqa: BLE001 - the autotuner skips configs that fail to compile too
            needs.append(f"{config}: {type(err).__name__}: {err}")
            continue
        if shared <= limit:
            kept.append(config)
            if first_only:
                break
        else:
            needs.append(f"{config}: {shared:,} B")
    if not kept:
        raise RuntimeError(f"no kernel config fits {limit:,} bytes of shared memory per block: " + "; ".join(needs))
    return kept


def first_fitting(configs: Sequence, shared_bytes: Callable[[Any], int], limit: int):
    """The first config of `configs` whose shared memory fits `limit` (see fitting_configs)."""
    return fitting_configs(configs, shared_bytes, limit, first_only=True)[0]


def _no_bench(kernel_call, quantiles):
    """The autotuner's timing when only one config is left: nothing to compare, so nothing is run
    (Triton 3.6 times even a lone survivor of the pruning; 3.9 skips it)."""
    return [0.0 for _ in quantiles]


class FittingPrune:
    """`early_config_prune` of an autotuned kernel: the configs that fit the launch device.

    `pre_prune` (another early_config_prune, e.g. by shape) runs first; then each config left is
    compiled for the launch (`warmup_shared`, which the autotuner's own run reuses) and kept while its
    shared memory fits the device's opt-in limit per block. With `single`, only the first that fits is
    kept, so the config list's order is the preference. Launches off CUDA (the interpreter) keep every
    config. `shared_bytes(config, named_args, kwargs)` and `limit` replace the compile and the device's
    limit (tests)."""

    def __init__(self, fn, *, single: bool = False, pre_prune=None, shared_bytes=None, limit: int | None = None):
        self.fn = fn
        self.single = single
        self.pre_prune = pre_prune
        self.shared_bytes = shared_bytes
        self.limit = limit

    def __call__(self, configs, named_args, **kwargs):
        if self.pre_prune is not None:
            configs = self.pre_prune(configs, named_args, **kwargs)
        device = next((v.device for v in named_args.values() if isinstance(v, torch.Tensor)), None)
        on_gpu = device is not None and device.type == "cuda"
        if not on_gpu and (self.shared_bytes is None or self.limit is None):
            return list(configs[:1]) if self.single else list(configs)
        limit = self.limit if self.limit is not None else device_shared_limit(device)
        if self.shared_bytes is not None:
            measure = functools.partial(self.shared_bytes, named_args=named_args, kwargs=kwargs)
        else:
            measure = functools.partial(warmup_shared, self.fn, list(named_args.values()), kwargs)
        try:
            return fitting_configs(configs, measure, limit, first_only=self.single)
        except RuntimeError as err:
            raise RuntimeError(f"{getattr(self.fn, '__name__', self.fn)}: {err}") from None


def autotune(configs, key, *, single: bool = False, pre_prune=None):
    """`triton.autotune` over the configs that fit the launch device (`FittingPrune`); with `single`
    (ATMA_TRITON_AUTOTUNE=0) the first that fits runs, untimed."""
    import triton

    def decorate(fn):
        prune = FittingPrune(fn, single=single, pre_prune=pre_prune)
        return triton.autotune(
            configs=configs,
            key=key,
            prune_configs_by={"early_config_prune": prune},
            do_bench=_no_bench if single else None,
        )(fn)

    return decorate


# ----------------------------------------------------------------------------------------------
# Launch arguments as a host launcher passes them, for compiling them ahead of time
# ----------------------------------------------------------------------------------------------

LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")


@dataclasses.dataclass
class Launch:
    """One recorded kernel launch: the kernel object (a JITFunction or an Autotuner), its arguments
    by name (launch options left out) and the launch options given (num_warps, ...)."""

    name: str
    kernel: Any
    args: dict[str, Any]
    options: dict[str, Any]

    @property
    def fn(self):
        """The @triton.jit function (under an autotuner's wrapping, if any)."""
        from triton.runtime.jit import JITFunction

        fn = self.kernel
        while not isinstance(fn, JITFunction):
            fn = fn.fn
        return fn


@contextlib.contextmanager
def recorded_launches(module, names: Sequence[str]) -> Iterator[list[Launch]]:
    """Within the block, the kernels `names` of `module` are not launched: each launch through
    `kernel[grid](...)` is appended to the yielded list instead. Call the module's host launchers
    with tensors on the meta device to get the arguments the model passes, without a GPU."""
    launches: list[Launch] = []
    originals = {name: getattr(module, name) for name in names}

    class _Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def record(*args, **kwargs):
                fn = Launch(self.name, self.kernel, {}, {}).fn
                named = dict(zip(fn.arg_names, args))
                options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
                launches.append(Launch(self.name, self.kernel, {**named, **kwargs}, options))

            return record

    try:
        for name, kernel in originals.items():
            setattr(module, name, _Recorder(name, kernel))
        yield launches
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)
