"""Activation checkpointing: every policy gives today's gradients, and selective AC keeps what it says.

The policies' memory and repeated work are measured on fake tensors by benchmarks/train/activation_memory.py
(the Triton kernels' ops, run here under TRITON_INTERPRET=1 in a subprocess: it must be set before triton
is imported); the assertions are on its JSON.
"""

import dataclasses
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from atma_titan.config import ActivationCheckpoint
from atma_titan.models.builder import build_model
from atma_titan.models.flavors import FLAVORS
from distributed_utils import ROOT

parallelize = importlib.import_module("atma_titan.parallel.parallelize")
POLICIES = [("selective", save) for save in parallelize.SELECTIVE_SAVES] + [("full", None)]
DEBUG = dataclasses.replace(FLAVORS["debug"], attention_impl="reference", memory_impl="reference")


def build(**ac):
    return build_model(DEBUG, torch.device("cpu"), lambda m: parallelize.apply_activation_checkpointing(m, **ac), 0)


def gradients(mode: str, save: str | None, blocks: str = "all") -> dict[str, torch.Tensor]:
    model = build(mode=mode, blocks=blocks, **({"save": save} if save else {}))
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    model(tokens).logsumexp(-1).mean().backward()
    return {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}


def test_the_config_allows_exactly_the_choices_the_mechanism_knows():
    """[activation_checkpoint] lists its allowed values in config.py, which does not import the parallel code;
    they must be the keys apply_activation_checkpointing looks up, or a valid config would fail at setup."""
    fields = {f.name: f.metadata["choices"] for f in dataclasses.fields(ActivationCheckpoint)}
    assert fields["blocks"] == tuple(parallelize.AC_BLOCKS)
    assert fields["selective_save"] == parallelize.SELECTIVE_SAVES


@pytest.fixture(scope="module")
def plain():
    return gradients("none", None)


@pytest.mark.parametrize("mode, save", POLICIES)
def test_every_policy_gives_the_gradients_of_no_checkpointing(plain, mode, save):
    checkpointed = gradients(mode, save)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("blocks", ["global", "local"])
def test_checkpointing_only_some_blocks_gives_the_same_gradients(plain, blocks):
    checkpointed = gradients("selective", "matmuls", blocks)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("blocks", ["all", "global", "local"])
def test_blocks_chooses_which_blocks_are_checkpointed(blocks):
    model = build(mode="selective", blocks=blocks)
    wrapped = {name: hasattr(block, "_checkpoint_wrapped_module") for name, block in model.blocks.items()}
    is_global = {name: model.args.is_global(int(name)) for name in model.blocks}
    assert any(is_global.values()) and not all(is_global.values())  # the debug model has both kinds
    local = {n: not g for n, g in is_global.items()}
    assert wrapped == {"all": {n: True for n in wrapped}, "global": is_global, "local": local}[blocks]


@pytest.mark.slow
def test_selective_keeps_the_kernels_and_trades_matmuls_for_memory(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "train" / "activation_memory.py"),
        "--config",
        "train_configs/debug_model.toml",
    ]
    cmd += ["--micro-batch", "4", "--seq-len", "256", "--tag", "test", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["policy"]: r for r in json.loads((tmp_path / "activation_memory-test.json").read_text())["rows"]}
    none, full = rows["none"], rows["full"]
    saves = [rows[f"selective, save = {s}"] for s in ("matmuls", "narrow_matmuls", "kernels")]
    # The kernels' outputs are kept by every selective policy: their forward runs once, not again in backward.
    assert none["kernel_forward_calls"] == 2 and full["kernel_forward_calls"] == 4
    assert all(r["kernel_forward_calls"] == 2 for r in saves)
    # save = matmuls repeats no matmul; the narrower saves hold less and repeat more.
    assert saves[0]["matmul_tflop"] == none["matmul_tflop"]
    memory = [r["peak_activation_gib"] for r in (none, *saves)]
    work = [r["matmul_tflop"] for r in saves]
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == 4, memory
    assert work == sorted(work) and len(set(work)) == 3, work
    # AC in the global blocks only: the local blocks keep their norms' outputs, so more than all blocks hold.
    only_global = rows["selective, global blocks"]
    assert saves[0]["peak_activation_gib"] < only_global["peak_activation_gib"] < none["peak_activation_gib"]
    assert only_global["matmul_tflop"] == none["matmul_tflop"] and only_global["kernel_forward_calls"] == 2
