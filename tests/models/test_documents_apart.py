"""Documents kept apart through the whole model (data.document_mask): a packed window of several documents
gives, document by document, the outputs and the gradients of each document run alone (float64, every
mixer: Polar or softmax attention, the Canon and LFM2 convolutions, the gated-delta memory)."""

import pytest
import torch
from documents import doc_start_from_lengths

from atma_titan.config import load_config
from atma_titan.data.boundaries import document_starts
from atma_titan.models import build_model, resolve_model_args

T = 32
# Per row, document lengths: row 0 starts documents mid-tile and mid-chunk (tiles and chunks of 8), at a chunk
# start (16) and has consecutive one-token documents; row 1 is one document.
LAYOUTS = [[5, 1, 1, 9, 16], [T]]
# The model keeps a few steps in float32 whatever its dtype (RMS norms, RoPE, the memory's gates, the soft-capped
# logits), and a packed and a lone document round differently there (their matmuls differ in shape): ~1e-7. A
# read across a document start moves outputs by ~1e-2 here (the kernels' own tests compare in float64 throughout).
CLOSE = dict(rtol=1e-5, atol=1e-5)


def float64_model(*overrides: str):
    cfg = load_config(["--model.attention_block", "8", "--model.memory_chunk", "8", *overrides])
    model = build_model(resolve_model_args(cfg.model), torch.device("cpu"), seed=0).double()
    # the init zeroes every residual branch's output and the head: move every weight off it, so that every
    # mixer's output and gradient carries signal
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def outputs_and_gradients(model, tokens, cotangent, doc_start=None, aux_weight=1.0, distractor_seed=0):
    """Logits, the auxiliary loss and every parameter's gradient of sum(logits * cotangent) + aux_weight * aux."""
    model.zero_grad()
    torch.manual_seed(distractor_seed)  # the distractor loss draws its random keys: the same ones in every run
    logits, aux = model(tokens, return_aux=True, doc_start=doc_start)
    loss = (logits * cotangent).sum() + (0 if aux is None else aux_weight * aux)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), (None if aux is None else aux.detach()), grads


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["--model.attention", "softmax"],
        ["--model.memory", "false"],
        ["--model.window", "6"],
        ["--model.position", "rope"],
        ["--model.global_layers", "all"],
        ["--model.distractor_weight", "0.01"],
    ],
    ids=lambda o: "-".join(x.lstrip("-").replace("model.", "") for x in o) or "default",
)
def test_packed_documents_match_each_document_alone(overrides):
    model = float64_model(*overrides)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.args.vocab_size, (len(LAYOUTS), T), generator=gen)
    cotangent = torch.randn(len(LAYOUTS), T, model.args.vocab_size, generator=gen, dtype=torch.float64)
    logits, aux, grads = outputs_and_gradients(model, tokens, cotangent, doc_start_from_lengths(LAYOUTS))

    alone_grads = {name: torch.zeros_like(g) for name, g in grads.items()}
    alone_aux = 0.0
    for row, lengths in enumerate(LAYOUTS):
        lo = 0
        for length in lengths:
            part = slice(lo, lo + length)
            # the auxiliary loss is a mean over the tokens: the packed one weighs each document by its length
            share = length / (len(LAYOUTS) * T)
            want, want_aux, want_grads = outputs_and_gradients(
                model, tokens[row : row + 1, part], cotangent[row : row + 1, part], aux_weight=share
            )
            torch.testing.assert_close(logits[row : row + 1, part], want, **CLOSE)
            for name, g in want_grads.items():
                alone_grads[name] += g
            if want_aux is not None:
                alone_aux += want_aux * share
            lo += length
    if aux is not None:
        torch.testing.assert_close(aux, torch.as_tensor(alone_aux, dtype=aux.dtype), **CLOSE)
    else:
        assert set(alone_grads) == set(grads)
    for name, g in grads.items():
        # summed over documents and tokens, the gradients gather more of that rounding
        torch.testing.assert_close(g, alone_grads[name], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_a_window_of_one_document_is_the_unmasked_window():
    model = float64_model()
    tokens = torch.randint(0, model.args.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    one_document = torch.zeros(2, T, dtype=torch.int32)
    torch.testing.assert_close(model(tokens, doc_start=one_document), model(tokens), rtol=1e-12, atol=1e-12)


def test_the_mask_changes_a_window_of_several_documents():
    model = float64_model()
    tokens = torch.randint(0, model.args.vocab_size, (2, T), generator=torch.Generator().manual_seed(3))
    masked, plain = model(tokens, doc_start=doc_start_from_lengths(LAYOUTS)), model(tokens)
    assert torch.equal(masked[1], plain[1])  # one document: the same
    assert not torch.allclose(masked[0, 5:], plain[0, 5:])  # after the first boundary: no longer


def test_documents_begin_at_each_eot_and_at_the_window_start():
    eot = 7
    inputs = torch.tensor([[3, 3, eot, 1, 2, eot, eot, 4], [eot, 1, 1, 1, 1, 1, 1, 1]])
    assert document_starts(inputs, eot).tolist() == [[0, 0, 2, 2, 2, 5, 6, 6], [0] * 8]


def test_a_cache_and_documents_together_are_refused():
    model = float64_model()
    with pytest.raises(ValueError, match="doc_start"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=object(), doc_start=torch.zeros(1, 4, dtype=torch.int32))
