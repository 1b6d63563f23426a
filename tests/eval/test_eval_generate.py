"""The generated needle (eval --generate): scoring of the tokens the model writes, the needle and records
probes through the generation engine on hand-made models with known answers, and, on an ATMA model, that
the free-running greedy tokens are what teacher-forced scoring predicts on the same prefix."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import HandModel, Induction, perturbed_debug_model

from atma_titan.data.synthetic import SyntheticSource
from atma_titan.data.tokenizer import ByteTokenizer
from atma_titan.eval import needle
from atma_titan.eval.corpus import FillerHaystack
from atma_titan.eval.needle import (
    GENERATED,
    build_needle,
    digit_tokens,
    evaluate_needle,
    generate_greedy,
    haystack_tokens_needed,
    run_needle,
    sample_needle,
    score_batch,
    score_generated,
)
from atma_titan.eval.records import evaluate_records

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def without_cache(monkeypatch):
    """Hand-made models have no KV cache: let the engine recompute the full forward for every token."""
    monkeypatch.setattr(needle, "generate_greedy", functools.partial(generate_greedy, use_cache=False))


def engine_ready(model: HandModel) -> HandModel:
    model.args = SimpleNamespace(vocab_size=model.vocab)  # what the engine checks prompts against
    return model


class ShortInduction(Induction):
    span = 3  # recalling `MARK key -> value` needs the last 3 tokens


# ---------------------------------------------------------------------------------------------
# Scoring


def test_score_generated_counts_digits_in_their_places_and_whole_values():
    # Byte-tokenizer values " 1 2 3": digits at offsets 1, 3, 5; the spaces count for exact only.
    expected = np.array([list(b" 1 2 3")] * 4)
    generated = np.array([list(b" 1 2 3"), list(b" 1 9 3"), list(b"x1 2 3"), list(b"9 1 2 ")])
    hits, exact = score_generated(generated, expected, [1, 3, 5])
    assert hits.tolist() == [[True] * 3, [True, False, True], [True] * 3, [False] * 3]
    assert exact.tolist() == [True, False, False, False]  # a wrong space spoils the whole value
    with pytest.raises(ValueError, match="differ in shape"):
        score_generated(generated[:, :4], expected, [1, 3])


def test_generated_needle_scores_a_fed_token_stream(monkeypatch):
    """A fake engine returns hand-made values; digit and exact accuracy are checked by hand."""
    tok = ByteTokenizer()
    table = digit_tokens(tok)
    hay = FillerHaystack(tok)
    trials = [
        build_needle(tok, hay.tokens(i, haystack_tokens_needed(64)), 64, record=r, digits=d, depth=0.5)
        for i, (r, d) in enumerate(sample_needle(0, i) for i in range(4))
    ]
    values = [t.value.copy() for t in trials]
    assert all(len(v) == 10 and t.value_offsets.tolist() == [1, 3, 5, 7, 9] for v, t in zip(values, trials))
    values[1][3] = table.scored[(sample_needle(0, 1)[1][1] + 1) % 10]  # trial 1: its 2nd digit wrong
    values[2][4] = ord("x")  # trial 2: every digit right, a space wrong
    values[3][:] = ord("x")  # trial 3: nothing right
    asked = {}

    def fake(model, prompts, new_tokens, *, max_batch, prefill_chunk=2048, use_cache=True):
        asked.update(prompts=[list(p) for p in prompts], new_tokens=new_tokens, max_batch=max_batch)
        return np.stack(values)

    monkeypatch.setattr(needle, "generate_greedy", fake)
    r = evaluate_needle(None, tok, hay, gap=64, depth=0.5, trials=4, generate=True, batch_tokens=1000)
    assert asked["prompts"] == [t.tokens[: t.value_at].tolist() for t in trials]  # up to the query's value
    assert asked["new_tokens"] == 10 and asked["max_batch"] == 1000 // (len(trials[0].tokens))
    assert r.mode == GENERATED and (r.ce, r.control_ce) == (None, None)
    assert r.digit_acc == pytest.approx((5 + 4 + 5 + 0) / 20) and r.exact_acc == 0.25
    assert r.line().endswith(f"generated: digit acc {100 * r.digit_acc:.1f}%, exact 25.0%")
    assert r.as_dict()["mode"] == "generated"


# ---------------------------------------------------------------------------------------------
# Through the engine on hand-made models


def test_perfect_induction_writes_every_value_and_a_blank_model_none(monkeypatch):
    without_cache(monkeypatch)
    tok = ByteTokenizer()
    lines = []
    results = run_needle(
        engine_ready(Induction(tok.vocab_size)), tok, FillerHaystack(tok), gaps=[48], depths=[0, 0.5], trials=2,
        generate=True, progress=lines.append,
    )  # fmt: skip
    assert [(r.depth, r.digit_acc, r.exact_acc, r.mode) for r in results] == [
        (0.0, 1.0, 1.0, GENERATED),
        (0.5, 1.0, 1.0, GENERATED),
    ]
    assert len(lines) == 2 and all("generated: digit acc 100.0%, exact 100.0%" in line for line in lines)
    # No guesses: zero logits, token 0 every time; nothing right.
    blank = evaluate_needle(engine_ready(HandModel(tok.vocab_size)), tok, FillerHaystack(tok), gap=48, trials=2,
                            generate=True)  # fmt: skip
    assert (blank.digit_acc, blank.exact_acc) == (0.0, 0.0)


def test_records_generated_by_perfect_recall(monkeypatch):
    without_cache(monkeypatch)
    source = SyntheticSource(64, seed=1)
    r = evaluate_records(engine_ready(ShortInduction(64)), source, gap=40, trials=3, generate=True)
    assert (r.variant, r.mode, r.digit_acc, r.exact_acc, r.ce, r.control_ce) == (
        "records", GENERATED, 1.0, 1.0, None, None
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# On an ATMA model, with the cache: generation agrees with teacher forcing


@pytest.fixture(scope="module")
def atma():
    """The debug model with its zero-initialised weights perturbed, so every block shapes the output."""
    return perturbed_debug_model(seed=0)


def test_generated_tokens_are_the_teacher_forced_argmax_of_their_own_prefix(atma):
    """Greedy free-running output g satisfies g[i] = argmax(model(prompt + g[:i])): teacher-forced scoring of
    the generated continuation predicts it at every place. So when the teacher-forced argmax is right at every
    value position, generation writes exactly the value; and its first token is always the teacher-forced one."""
    tok = ByteTokenizer()
    hay = FillerHaystack(tok)
    trials = [
        build_needle(tok, hay.tokens(i, haystack_tokens_needed(96)), 96, record=r, digits=d)
        for i, (r, d) in enumerate(sample_needle(3, i) for i in range(3))
    ]
    prompts = [t.tokens[: t.value_at] for t in trials]
    n = len(trials[0].value)
    generated = generate_greedy(atma, prompts, n, max_batch=2, prefill_chunk=64)  # 3 prefill chunks per prompt
    assert generated.shape == (3, n)
    at = len(prompts[0]) - 1 + np.arange(n)  # logits at p - 1 predict p

    # teacher-forced on prompt + generated: the argmax at each place is the generated token
    own = torch.as_tensor(np.stack([np.concatenate([p, g]) for p, g in zip(prompts, generated)]))
    pred, _ = score_batch(atma, own[:, :-1], torch.as_tensor(np.stack([at] * 3)), own[:, -n:])
    assert np.array_equal(pred.numpy(), generated)

    # teacher-forced on the true sequence: the same first token, and the same tokens up to the first mistake
    true = torch.as_tensor(np.stack([t.tokens for t in trials]))
    pred, _ = score_batch(atma, true[:, :-1], torch.as_tensor(np.stack([at] * 3)), true[:, -n:])
    assert np.array_equal(pred[:, 0].numpy(), generated[:, 0])
    for row, t in zip(range(3), trials):
        wrong = np.flatnonzero(generated[row] != t.value)
        upto = (wrong[0] if len(wrong) else n - 1) + 1
        assert np.array_equal(pred[row, :upto].numpy(), generated[row, :upto])
    assert atma.training is False


def test_the_generated_needle_scores_what_the_engine_writes(atma, monkeypatch):
    """evaluate_needle(generate=True) on the ATMA model = score_generated of the engine's tokens."""
    tok = ByteTokenizer()
    seen = []

    def spy(*args, **kwargs):
        seen.append(generate_greedy(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(needle, "generate_greedy", spy)
    r = evaluate_needle(atma, tok, FillerHaystack(tok), gap=64, trials=3, generate=True, variant="passkey")
    hay = FillerHaystack(tok)
    trials = [
        build_needle(tok, hay.tokens(i, haystack_tokens_needed(64)), 64, record=rec, digits=d, variant="passkey")
        for i, (rec, d) in enumerate(sample_needle(0, i) for i in range(3))
    ]
    hits, exact = score_generated(seen[0], np.stack([t.value for t in trials]), trials[0].value_offsets)
    assert (r.digit_acc, r.exact_acc) == (hits.mean(), exact.mean())
