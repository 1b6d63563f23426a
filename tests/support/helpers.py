"""Helpers shared by several test modules: kernel input builders and comparisons, hand-made models
with known outputs, and the small training jobs the trainer and eval tests run.

Polar attention: `make_inputs`, `random_cotangents`, `grads_of` (tests/kernels/test_polar_reference.py,
tests/kernels/interpreter/polar_triton_cases.py, tests/kernels/test_polar_triton.py); `documents_alone`
(tests/kernels/test_polar_documents.py, tests/kernels/interpreter/polar_documents_cases.py).
Gated delta rule: `random_inputs`, `cast`, `random_step`, `exact_step`, `compare_to_float64`, `assert_relative_close`
(tests/kernels/test_gated_delta_reference.py, tests/kernels/interpreter/gated_delta_triton_cases.py,
tests/kernels/test_gated_delta_triton.py). Evaluation: `HandModel`, `Induction` (tests/eval/test_eval.py,
tests/eval/test_eval_records.py). Training: `SMALL`, `EVAL_TRAIN`.
Triton's CPU interpreter: `run_interpreter_cases` (the kernel test modules).
"""

import os
import re
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from atma_titan.kernels.gated_delta.reference import gated_delta_chunked, gated_delta_recurrent, gated_delta_step
from distributed_utils import ROOT
from documents import document_spans

F64 = torch.float64

# ---------------------------------------------------------------------------------------------
# Polar attention


PARAM_NAMES = ("q", "k", "v", "len_gain", "null_base", "null_slope", "mag_beta", "v_null")


def make_inputs(b, tq, tk, h, hkv, d, *, dtype=torch.float64, seed=0, requires_grad=True):
    """Random q, k, v and random (not init-valued) per-head parameters."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift
        return x.to(dtype).requires_grad_(requires_grad)

    return [
        rand(b, tq, h, d),
        rand(b, tk, hkv, d),
        rand(b, tk, hkv, d),
        rand(h, shift=-0.5),  # len_gain
        rand(h, shift=1.0),  # null_base
        rand(h),  # null_slope
        rand(h, shift=-1.0),  # mag_beta
        rand(h, d, scale=0.5),  # v_null
    ]


def random_cotangents(c, mag, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(c.shape, generator=gen, dtype=torch.float64).to(c.dtype),
        torch.randn(mag.shape, generator=gen, dtype=torch.float64).to(mag.dtype),
    )


def grads_of(fn, inputs, g_c, g_mag, **kw):
    c, mag = fn(*inputs, **kw)
    loss = (c * g_c).sum() + (mag * g_mag).sum()
    return torch.autograd.grad(loss, inputs)


def documents_alone(fn, inputs, doc_start, g_c, g_mag, **kw):
    """What `fn(*inputs, doc_start=doc_start, **kw)` must give: each document of each sequence run alone
    (doc_start=None on its slice of q, k, v), assembled into the packed layout. Returns c, mag and the
    gradients of <c, g_c> + <mag, g_mag> with respect to every input (the per-head ones summed over the
    documents). With Tq < Tk a document's queries are its positions among the last Tq."""
    q, k, v, *params = inputs
    tq, tk = q.shape[1], k.shape[1]
    offset = tk - tq
    c, mag = torch.empty_like(q), q.new_empty(q.shape[:3])
    loss = 0.0
    for b in range(q.shape[0]):
        for first, end in document_spans(doc_start)[b]:
            rows = slice(max(first, offset) - offset, end - offset)
            if rows.start >= rows.stop:
                continue  # a document wholly before the queries
            c_doc, mag_doc = fn(q[b : b + 1, rows], k[b : b + 1, first:end], v[b : b + 1, first:end], *params, **kw)
            c[b, rows], mag[b, rows] = c_doc[0].detach(), mag_doc[0].detach()
            loss = loss + (c_doc[0] * g_c[b, rows]).sum() + (mag_doc[0] * g_mag[b, rows]).sum()
    grads = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)
    return c, mag, grads


# ---------------------------------------------------------------------------------------------
# Gated delta rule

NAMES = ("q", "k", "v", "log_gamma", "beta", "initial_state")


def random_inputs(
    batch=2,
    seq_len=37,
    heads=3,
    key_dim=8,
    value_dim=6,
    dtype=F64,
    seed=0,
    with_initial_state=True,
    requires_grad=False,
    device="cpu",
):
    """q, k, v, log_gamma, beta, initial_state as leaves (gates drawn as the model draws them)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    tensors = {
        "q": randn(batch, seq_len, heads, key_dim),
        "k": randn(batch, seq_len, heads, key_dim),
        "v": randn(batch, seq_len, heads, value_dim),
        # gamma = sigmoid(x + 2) ~ 0.88 on average, log space as the API expects
        "log_gamma": F.logsigmoid(randn(batch, seq_len, heads) + 2.0),
        "beta": torch.sigmoid(randn(batch, seq_len, heads)),
        "initial_state": randn(batch, heads, value_dim, key_dim) if with_initial_state else None,
    }
    return {
        name: None if x is None else x.to(device=device, dtype=dtype).requires_grad_(requires_grad)
        for name, x in tensors.items()
    }


def cast(inputs, dtype):
    """q, k, v in dtype; gates and the initial state in float32 (as the model feeds them)."""
    out = {}
    for name, x in inputs.items():
        if x is not None:
            x = x.to(dtype if name in ("q", "k", "v") else torch.float32)
        out[name] = x
    return out


def outputs_and_grads(fn, inputs, r_weight, state_weight, **kwargs):
    """(r, final_state, {name: grad}) of loss = <r, r_weight> + <final_state, state_weight>."""
    leaves = {name: x.detach().clone().requires_grad_(True) for name, x in inputs.items() if x is not None}
    args = {name: leaves.get(name) for name in NAMES}
    r, state = fn(**args, **kwargs)
    loss = (r.to(F64) * r_weight).sum() + (state.to(F64) * state_weight).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return r, state, dict(zip(leaves, grads))


def compare_to_float64(fn, inputs, dtype, tol, seed=1, **kwargs):
    """Run fn on inputs rounded to dtype and the float64 recurrence on the same rounded values."""
    low = cast(inputs, dtype)
    exact = {name: None if x is None else x.to(F64) for name, x in low.items()}
    gen = torch.Generator().manual_seed(seed)
    batch, seq_len, heads, value_dim = inputs["v"].shape
    key_dim = inputs["k"].shape[-1]
    device = inputs["v"].device
    r_weight = torch.randn(batch, seq_len, heads, value_dim, generator=gen, dtype=F64).to(device)
    state_weight = torch.randn(batch, heads, value_dim, key_dim, generator=gen, dtype=F64).to(device)
    reference = gated_delta_recurrent if seq_len <= 256 else gated_delta_chunked
    r_ref, state_ref, grads_ref = outputs_and_grads(reference, exact, r_weight, state_weight, **kwargs)
    r, state, grads = outputs_and_grads(fn, low, r_weight, state_weight, **kwargs)
    assert r.dtype == dtype and r.shape == r_ref.shape
    assert state.dtype == torch.float32 and state.shape == state_ref.shape
    assert_relative_close(r, r_ref, tol, "r")
    assert_relative_close(state, state_ref, tol, "final_state")
    assert set(grads) == set(grads_ref)
    for name in grads_ref:
        assert grads[name].dtype == low[name].dtype, name
        assert_relative_close(grads[name], grads_ref[name], tol, f"d{name}")


def assert_relative_close(actual, expected, tol, name):
    """Worst absolute error against the largest reference entry: fails on a wrong element anywhere."""
    actual, expected = actual.to(F64), expected.to(F64)
    assert torch.isfinite(actual).all(), f"{name} has non-finite values"
    error = (actual - expected).abs().max().item()
    scale = max(expected.abs().max().item(), 1e-3)
    assert error <= tol * scale, f"{name}: max error {error:.3e} > {tol:.1e} x {scale:.3e}"


def random_step(batch, heads, key_dim, value_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(batch, heads, key_dim, generator=gen),
        "k": torch.randn(batch, heads, key_dim, generator=gen),
        "v": torch.randn(batch, heads, value_dim, generator=gen),
        "log_gamma": F.logsigmoid(torch.randn(batch, heads, generator=gen) + 2.0),
        "beta": torch.sigmoid(torch.randn(batch, heads, generator=gen)),
    }


def exact_step(state, token):
    """float64 gated_delta_step on normalised q, k."""
    t = {name: x.to(F64) for name, x in token.items()}
    q, k = F.normalize(t["q"], dim=-1, eps=1e-6), F.normalize(t["k"], dim=-1, eps=1e-6)
    return gated_delta_step(state.to(F64), q, k, t["v"], t["log_gamma"], t["beta"])


# ---------------------------------------------------------------------------------------------
# Hand-made models for the evaluation tests


class HandModel(nn.Module):
    """trunk() returns `scale` * one-hot(predicted next token), or zeros where it has no guess; head is identity."""

    def __init__(self, vocab: int, scale: float = 50.0):
        super().__init__()
        self.vocab, self.scale = vocab, scale
        self.head = nn.Linear(vocab, vocab, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(vocab))

    def guess(self, tokens: np.ndarray) -> np.ndarray:  # (T,) -> (T,) token or -1
        return np.full(len(tokens), -1)

    def trunk(self, tokens: torch.Tensor):
        h = torch.zeros(*tokens.shape, self.vocab)
        for b, row in enumerate(tokens.cpu().numpy()):
            for t, g in enumerate(self.guess(row)):
                if g >= 0:
                    h[b, t, g] = self.scale
        return h.to(tokens.device), None


class Induction(HandModel):
    """Exact induction: find the earlier place where the last `span` tokens occurred, predict what followed."""

    span = 8

    def guess(self, tokens):
        m, out = self.span, np.full(len(tokens), -1)
        windows = np.lib.stride_tricks.sliding_window_view(tokens, m)
        for t in range(m - 1, len(tokens)):
            hits = np.flatnonzero((windows[: t - m + 1] == tokens[t - m + 1 : t + 1]).all(axis=1))
            if len(hits):
                out[t] = tokens[hits[-1] + m]
        return out


# ---------------------------------------------------------------------------------------------
# Small training jobs

# A 3-step job of the debug model at 32 tokens (tests/train/test_train.py, tests/data/test_train_data.py).
SMALL = [
    "--training.steps",
    "3",
    "--training.seq_len",
    "32",
    "--training.batch_tokens",
    "256",
    "--training.micro_batch_size",
    "4",
    "--metrics.log_freq",
    "1",
    "--job.print_config",
    "false",
]

# A 2-step job that checkpoints every step and exports safetensors, for the eval tests.
EVAL_TRAIN = [
    "--training.steps",
    "2",
    "--training.seq_len",
    "32",
    "--training.batch_tokens",
    "128",
    "--training.micro_batch_size",
    "4",
    "--metrics.stdout",
    "false",
    "--job.print_config",
    "false",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "1",
    "--checkpoint.export_safetensors",
    "true",
]


# ---------------------------------------------------------------------------------------------
# Generation


def perturbed_debug_model(device=torch.device("cpu"), seed: int = 1, **overrides):
    """The debug model (with `overrides` of its ModelArgs) whose zero-initialised weights are made random,
    so every block shapes the output (the initial weights zero the residual outputs: all logits 0)."""
    import dataclasses

    from atma_titan.models import FLAVORS, build_model

    model = build_model(dataclasses.replace(FLAVORS["debug"], **overrides), device, seed=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if torch.all(p == 0):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Triton's CPU interpreter


def run_interpreter_cases(cases: str, timeout: int = 600) -> None:
    """Run tests/kernels/interpreter/`cases` in a fresh pytest with TRITON_INTERPRET=1: the variable must be
    set before triton is first imported, and another test module of this process may already have imported
    it (the folder's conftest.py checks that, and hides the GPU and takes one thread). Every case must pass
    (none skipped). One process (`-n 0`): pyproject's xdist workers already fill the cores."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    path = f"tests/kernels/interpreter/{cases}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", path]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]  # "N passed[, M skipped] in S s"
    assert " passed" in summary and not re.search(r"\d+ skipped", summary), proc.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# Commands


def run_eval(*args: str) -> subprocess.CompletedProcess:
    """`python -m atma_titan.eval ARGS` from the repository root, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "atma_titan.eval", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
