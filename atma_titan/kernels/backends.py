"""Which implementation of a kernel runs, and the environment flags of the Triton kernels.

`auto` picks Triton on CUDA (when triton is installed) and the reference elsewhere: on CPU the Triton
interpreter is correct but orders of magnitude slower than the reference, so it is only taken when
asked for (`triton` with TRITON_INTERPRET=1, as the kernel tests do).

The environment is read here, once, at import, and nowhere else: the entry points ask on every
forward, inside compiled blocks, where dynamo cannot trace os.environ or importlib, and
TRITON_INTERPRET only takes effect if it is set before triton is imported anyway.

- `INTERPRET`: TRITON_INTERPRET=1, the Triton interpreter on the CPU (tests).
- `AUTOTUNE`: False with ATMA_TRITON_AUTOTUNE=0, where the kernels take the first config of their list
  whose compiled shared memory fits the device, untimed (tests, where tuning time dominates and speed
  is irrelevant); the lists' first configs fit an L4, an A100 and an H100 / H200 alike (resources.py).
- `COPY_ENGINE`: False with ATMA_TRITON_COPY_ENGINE=0, where the Polar attention kernels load their tiles
  on Hopper as on every other GPU instead of through Hopper's copy engine (tensor descriptors): the
  baseline of a comparison, or a way around a driver or Triton release that mishandles descriptors.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = [
    "AUTOTUNE",
    "COPY_ENGINE",
    "INTERPRET",
    "autotune_choices",
    "built_for_interpreter",
    "gradients_flow",
    "kernel_module",
    "triton_installed",
    "triton_runs_on",
    "use_triton",
]

_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
AUTOTUNE = os.environ.get("ATMA_TRITON_AUTOTUNE", "1") != "0"
COPY_ENGINE = os.environ.get("ATMA_TRITON_COPY_ENGINE", "1") != "0"


def gradients_flow(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will differentiate through an op on `tensors`: the test for a hand-written
    backward (the MLP, the conv mixer, the fused loss) and for keeping a kernel's workspaces for one."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def triton_runs_on(device: torch.device) -> bool:
    """True when a Triton kernel can launch on `device`: a GPU, or the CPU under TRITON_INTERPRET=1."""
    if not _TRITON_INSTALLED:
        return False
    return device.type == "cuda" or (device.type == "cpu" and INTERPRET)


def use_triton(impl: str, device: torch.device, what: str) -> bool:
    """Resolve `impl` (auto | triton | reference) for tensors on `device`; `what` names the setting
    in error messages (e.g. the config key `model.memory_impl`)."""
    if impl == "reference":
        return False
    if impl == "auto":
        return device.type == "cuda" and triton_installed()
    if impl == "triton":
        if not triton_runs_on(device):
            raise RuntimeError(
                f"{what} = 'triton' cannot run on {device.type}: "
                + (
                    "triton is not installed"
                    if not triton_installed()
                    else "the Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU (slow; for tests)"
                )
                + f"; use {what} = 'auto' or 'reference'"
            )
        return True
    raise ValueError(f"{what} = {impl!r} is unknown")


def built_for_interpreter(kernel) -> bool:
    """Whether triton built `kernel` (a @triton.jit function) for its interpreter. Triton decides when
    the decorator runs, from TRITON_INTERPRET at that moment: a kernel module imported after the
    variable changed disagrees with `INTERPRET`."""
    from triton.runtime.jit import JITFunction

    return not isinstance(kernel, JITFunction)


def autotune_choices(module) -> dict[str, list[str]]:
    """The configs the autotuner picked so far, per kernel of `module` (benchmarks record them, so the
    lists of candidates can be pruned to what wins on a given GPU)."""
    from triton.runtime.autotuner import Autotuner

    choices = {}
    for name, kernel in vars(module).items():
        if isinstance(kernel, Autotuner):
            picked = set(kernel.cache.values()) or {getattr(kernel, "best_config", None)} - {None}
            if picked:
                choices[name] = sorted(str(config) for config in picked)
    return choices


def kernel_module(module: str, device: torch.device, kernel: str, probe: str, reference: str):
    """Import the Triton kernel module `module` (e.g. "atma_titan.kernels.polar.triton_attention") for tensors
    on `device`, or raise RuntimeError saying why it cannot run. `kernel` names it in the messages,
    `probe` is one of its @triton.jit functions (to tell whether it was built for the interpreter) and
    `reference` what to call instead."""
    if device.type == "cpu" and not INTERPRET:
        raise RuntimeError(
            f"{kernel} runs on CPU only under TRITON_INTERPRET=1 (set before triton is imported); use "
            f"{reference} on CPU instead"
        )
    try:
        kernels = importlib.import_module(module)
    except ImportError as err:  # pragma: no cover - depends on the machine
        raise RuntimeError(f"{kernel} needs triton; use {reference} instead") from err
    if device.type == "cpu" and not built_for_interpreter(getattr(kernels, probe)):
        name = module.rsplit(".", 1)[-1]
        raise RuntimeError(f"{name} was imported before TRITON_INTERPRET=1 was set; set it before importing")
    return kernels
