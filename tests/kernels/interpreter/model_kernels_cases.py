"""The model with `attention_impl` / `memory_impl = triton` against the PyTorch references.

Run by test_model_kernels.py (alone: see this folder's conftest.py). Tiny shapes: the interpreter executes
every Triton program in Python.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from atma_titan.models import ATMA
from atma_titan.models.flavors import FLAVORS

TINY = dataclasses.replace(
    FLAVORS["debug"], vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=64, n_layers=2
)
TINY = dataclasses.replace(TINY, global_layers=(1,), memory_chunk=16, attention_block=16)


def perturbed_model(args) -> ATMA:
    """Initial weights plus noise: the zero-initialised output projections would hide the mixers."""
    torch.manual_seed(0)
    model = ATMA(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def logits_and_grads(model: ATMA, tokens: torch.Tensor):
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("kernel", ["attention", "memory", "both"])
def test_model_with_triton_kernels_matches_reference(kernel, window):
    impls = {
        "attention_impl": "triton" if kernel in ("attention", "both") else "reference",
        "memory_impl": "triton" if kernel in ("memory", "both") else "reference",
    }
    reference = perturbed_model(
        dataclasses.replace(TINY, window=window, attention_impl="reference", memory_impl="reference")
    )
    fused = perturbed_model(dataclasses.replace(TINY, window=window, **impls))
    fused.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, TINY.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))  # ragged T
    want_logits, want_grads = logits_and_grads(reference, tokens)
    got_logits, got_grads = logits_and_grads(fused, tokens)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-4, rtol=1e-4)
    assert want_grads.keys() == got_grads.keys()
    for name, want in want_grads.items():
        # fp32 summation order differs between the kernels and the references: compare on each tensor's scale
        error = (got_grads[name] - want).abs().max().item()
        assert error <= 2e-3 * want.abs().max().item() + 1e-6, f"{name}: max error {error:.3g}"


def test_compiled_global_block_has_no_graph_break():
    args = dataclasses.replace(TINY, attention_impl="triton", memory_impl="triton")
    model = perturbed_model(args)
    block = model.blocks["1"]
    h = torch.randn(2, 21, args.d_model, requires_grad=True)
    want, _ = block(h)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")  # fullgraph: a break is an error
    got, _ = compiled(h)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()
