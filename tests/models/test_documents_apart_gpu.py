"""Documents kept apart on the GPU: the model on its Triton kernels under bf16 autocast, as training runs it,
against the same weights in float64 on the PyTorch references (tests/models/test_documents_apart.py shows those
equal each document run alone)."""

import pytest
import torch
from documents import doc_start_from_lengths

from atma_titan.config import load_config
from atma_titan.models import build_model, resolve_model_args

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
T = 320
# documents across the kernels' tiles (Polar 16-128, the memory's chunk of 64, the conv's row tiles), one-token
# documents, and a window that is one document
LAYOUTS = [[100, 1, 1, 60, 63, 95], [T]]
KERNELS = ("attention_impl", "memory_impl", "conv_impl", "mlp_impl")


def gpu_model(impl: str):
    overrides = [arg for key in KERNELS for arg in (f"--model.{key}", impl)]
    cfg = load_config(overrides)
    return build_model(resolve_model_args(cfg.model), torch.device("cuda"), seed=0)


def logits_and_grads(model, tokens, doc_start, cotangent, autocast: bool):
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens, doc_start=doc_start)
    (logits.double() * cotangent).sum().backward()
    return logits.detach().double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


@needs_cuda
@pytest.mark.gpu
def test_triton_kernels_in_bf16_follow_the_float64_reference_with_documents():
    fast, exact = gpu_model("triton"), gpu_model("reference").double()
    exact.load_state_dict({k: v.double() for k, v in fast.state_dict().items()})
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, fast.args.vocab_size, (len(LAYOUTS), T), generator=gen).cuda()
    cotangent = torch.randn(len(LAYOUTS), T, fast.args.vocab_size, generator=gen, dtype=torch.float64).cuda()
    doc_start = doc_start_from_lengths(LAYOUTS).cuda()
    # the init zeroes every residual output: train a little first so every path carries signal
    optimizer = torch.optim.SGD(fast.parameters(), lr=0.05)
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fast(tokens, doc_start=doc_start).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    exact.load_state_dict({k: v.double() for k, v in fast.state_dict().items()})
    logits, grads = logits_and_grads(fast, tokens, doc_start, cotangent, autocast=True)
    want_logits, want_grads = logits_and_grads(exact, tokens, doc_start, cotangent, autocast=False)
    scale = want_logits.abs().max().item()
    assert (logits - want_logits).abs().max().item() <= 0.03 * scale + 1e-3
    for name, want in want_grads.items():
        err, scale = (grads[name] - want).abs().max().item(), want.abs().max().item()
        assert err <= 0.05 * scale + 1e-4, f"{name}: max error {err:.3g} against a scale of {scale:.3g}"
