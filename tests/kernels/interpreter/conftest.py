"""The Triton interpreter cases: each `<op>_cases.py` runs an op's Triton kernels on the CPU under Triton's
interpreter, against float64 references. They need TRITON_INTERPRET=1 set before triton is imported (the
@triton.jit decorator and atma_titan.kernels.backends read it once), no visible GPU and one thread.

tests/kernels/test_<op>.py runs its cases in a fresh pytest (helpers.run_interpreter_cases): the suite's
own process may have imported triton already. By hand, one file or the whole folder:
    TRITON_INTERPRET=1 python -m pytest -q -n 0 -p no:cacheprovider tests/kernels/interpreter/glu_cases.py
    TRITON_INTERPRET=1 python -m pytest -q -n 0 -p no:cacheprovider tests/kernels/interpreter

The suite's own run passes over this folder without collecting the cases (their names do not start with
test_); this file then imports neither torch nor triton and leaves the environment alone. Only a case file
or this folder named on the command line is collected, after the checks below.
"""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    named = named_here(config)
    if not named:
        return  # a run over the suite: the cases run through run_interpreter_cases
    how_to_run = (
        "run them through the matching tests/kernels/test_*.py, or alone with\n"
        f"    TRITON_INTERPRET=1 python -m pytest -q -n 0 -p no:cacheprovider {' '.join(named)}"
    )
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError(f"the Triton interpreter cases need TRITON_INTERPRET=1: {how_to_run}")
    stale = built_without_the_interpreter()
    if stale:
        raise pytest.UsageError(
            f"{', '.join(stale)} decided against the interpreter: imported before TRITON_INTERPRET=1 was set; "
            + how_to_run
        )
    hide_the_gpu_and_use_one_thread()
    broken = interpreter_cannot_index()
    if broken:
        raise pytest.UsageError(broken)


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    """This folder named: its case files too (pytest's own collector takes only test_*.py, or a named file)."""
    if file_path.name.endswith("_cases.py") and parent.session.isinitpath(file_path.parent):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def named_here(config: pytest.Config) -> list[str]:
    """The arguments of the command line that name this folder or a file in it, relative to the root."""
    named = []
    for arg in config.args:
        path = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if path == HERE or path.parent == HERE:
            named.append(str(path.relative_to(config.rootpath)))
    return named


def built_without_the_interpreter() -> list[str]:
    """The modules of this process that fixed the kernels' build before TRITON_INTERPRET=1 was set: the
    backend flags and any module holding a @triton.jit function compiled for the GPU."""
    stale = []
    backends = sys.modules.get("atma_titan.kernels.backends")
    if backends is not None and not backends.INTERPRET:
        stale.append(backends.__name__)
    if "triton" in sys.modules:
        from triton.runtime.jit import JITFunction  # InterpretedFunction under the interpreter

        for name, module in list(sys.modules.items()):
            if name.startswith("atma_titan.") and any(isinstance(v, JITFunction) for v in vars(module).values()):
                stale.append(name)
    return stale


def hide_the_gpu_and_use_one_thread() -> None:
    """The cases check the CPU path: with a GPU visible, whatever picks its device from torch.cuda would
    leave it. From the suite they run beside its workers, whose cores they would compete for (see
    tests/conftest.py)."""
    import torch

    if torch.cuda.is_initialized():
        raise pytest.UsageError("CUDA was initialised before the interpreter cases could hide the GPU")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["OMP_NUM_THREADS"] = "1"  # for the processes the cases start (torch.compile's workers)
    torch.set_num_threads(1)


def interpreter_cannot_index() -> str | None:
    """Why this Triton's interpreter cannot run the kernels, or None. Older interpreters (3.6, say) keep a
    program id as a one-element array and take it as a Python int through int(array), which NumPy 2.4
    refuses: every kernel whose loop bounds come from its program id then fails inside the interpreter."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _loop_from_program_id(x):
        pid = tl.program_id(0)
        for i in range(pid, pid + 1):
            tl.store(x + i, i)

    try:
        _loop_from_program_id[(1,)](torch.zeros(1, dtype=torch.int32))
    except Exception as e:  # noqa: BLE001 (any failure here is the environment's, reported as such)
        return (
            f"Triton {triton.__version__}'s interpreter cannot run these kernels with NumPy {np.__version__} "
            f"(a program id used as a loop bound: {e!r}); install a newer Triton (3.9 works)"
        )
    return None
