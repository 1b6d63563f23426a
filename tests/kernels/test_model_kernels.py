"""Kernel selection in the model: `model.attention_impl` and `model.memory_impl`.

tests/kernels/interpreter/model_kernels_cases.py runs the model with the Triton kernels under TRITON_INTERPRET=1
in a subprocess and compares it with the references; the rest checks how `auto` / `triton` resolve.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_interpreter_cases

from atma_titan.config import ConfigError, load_config
from atma_titan.kernels.backends import use_triton
from atma_titan.models import resolve_model_args


@pytest.mark.slow
def test_model_with_triton_kernels_under_the_interpreter():
    run_interpreter_cases("model_kernels_cases.py", timeout=900)


def test_auto_takes_the_reference_on_cpu_and_triton_on_cuda():
    assert not use_triton("auto", torch.device("cpu"), "model.attention_impl")
    assert not use_triton("reference", torch.device("cuda"), "model.attention_impl")
    assert use_triton("auto", torch.device("cuda"), "model.memory_impl")


def test_triton_on_cpu_without_the_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.setattr("atma_titan.kernels.backends.INTERPRET", False)
    with pytest.raises(RuntimeError, match=r"model.memory_impl = 'triton' cannot run on cpu.*'auto' or 'reference'"):
        use_triton("triton", torch.device("cpu"), "model.memory_impl")


def test_impl_keys_are_validated():
    args = resolve_model_args(load_config(["--model.attention_impl", "reference", "--model.memory_impl", "fla"]).model)
    assert (args.attention_impl, args.memory_impl) == ("reference", "fla")
    with pytest.raises(ConfigError, match="attention_impl"):
        load_config(["--model.attention_impl", "cuda"])
