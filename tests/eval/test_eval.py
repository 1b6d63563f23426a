"""Evaluation: the needle's exact token layout (byte and BPE tokenizers), scoring and the length curve on
hand-made models with known outputs, long-document sources, the report, and the command end to end on a
debug checkpoint (DCP and safetensors)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import HandModel, Induction, run_eval

from atma_titan.data.shards import BinShards, write_shard
from atma_titan.data.tokenizer import ByteTokenizer, HFTokenizer
from atma_titan.eval import (
    FILLER,
    EvalInputError,
    FillerHaystack,
    LongDocuments,
    build_needle,
    digit_tokens,
    evaluate_needle,
    length_curve,
    length_sequences,
    nested_prefix_nll,
    plot_length_curves,
    plot_needle,
    quick_needle,
    run_needle,
    sample_needle,
    score_batch,
    token_losses,
    write_results,
)
from atma_titan.checkpoint.errors import CheckpointError
from atma_titan.checkpoint.open import resolve_checkpoint
from atma_titan.eval import corpus as corpus_module
from atma_titan.eval.__main__ import main as eval_main
from atma_titan.compare import main as compare_main
from atma_titan.eval.corpus import DocumentHaystack, TokenCorpus, shard_documents, text_documents
from atma_titan.eval.needle import ACCESS_CUE, PASSKEY_CUE
from atma_titan.eval.plots import dodge_factors, needle_figure, needle_panels
from atma_titan.eval.report import RESULT_UNITS, results_markdown
from atma_titan.models import ATMA, FLAVORS

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe():
    """A tiny byte-level BPE trained here, on text that makes " 0" .. " 9" merge into single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [FILLER] * 20 + [" 0 1 2 3 4 5 6 7 8 9" * 20] * 20 + [" The access code for record 7 is 1 2 3"] * 10
    tk.train_from_iterator(corpus, trainer)
    return HFTokenizer(tk, "tiny-bpe")


def expected_layout(tok, hay, gap, cue, value_pieces, k=0):
    block = tok.encode(cue) + [t for piece in value_pieces for t in piece]
    return [tok.eot_id] + list(hay[:k]) + block + list(hay[k:gap]) + block


def test_byte_tokenizer_writes_space_then_digit_and_scores_the_digit_byte():
    tok = ByteTokenizer()
    table = digit_tokens(tok)
    assert table.pieces[3] == (32, 51) and table.scored[3] == 51 and table.space_separate
    hay = FillerHaystack(tok).tokens(0, 200)
    trial = build_needle(tok, hay, 50, record=1234567, digits=(3, 0, 9, 9, 1))
    value = [32, 51, 32, 48, 32, 57, 32, 57, 32, 49]  # b" 3 0 9 9 1"
    want = [256] + list(b" The access code for record 1234567 is") + value + list(hay[:50])
    want += list(b" The access code for record 1234567 is") + value
    assert trial.tokens.tolist() == want
    n = len(want)
    assert trial.targets.tolist() == [n - 9, n - 7, n - 5, n - 3, n - 1]  # the digit bytes, not the spaces
    assert trial.tokens[trial.targets].tolist() == list(b"30991") == trial.target_ids.tolist()
    assert trial.needle_at == 1 and trial.query_at == n - 48


def test_bpe_layout_is_the_concatenation_of_separately_tokenised_pieces(bpe):
    pieces = {d: bpe.encode(f" {d}") for d in range(10)}
    assert all(len(p) == 1 for p in pieces.values()), pieces  # the tokenizer makes " d" one token
    table = digit_tokens(bpe)
    assert not table.space_separate and table.scored == tuple(p[0] for p in pieces.values())
    hay = FillerHaystack(bpe).tokens(0, 300)
    assert hay[: len(bpe.encode(" " + FILLER))].tolist() == bpe.encode(" " + FILLER)
    digits = (4, 4, 0, 7, 2)
    trial = build_needle(bpe, hay, 100, record=7654321, digits=digits)
    cue = ACCESS_CUE.format(record=7654321)
    assert trial.tokens.tolist() == expected_layout(bpe, hay, 100, cue, [pieces[d] for d in digits])
    n = len(trial.tokens)
    assert trial.targets.tolist() == list(range(n - 5, n))
    assert trial.target_ids.tolist() == [pieces[d][0] for d in digits]


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_depth_places_the_needle_inside_the_haystack(bpe, depth):
    hay = FillerHaystack(bpe).tokens(0, 400)
    digits = (1, 2, 3, 4, 5)
    trial = build_needle(bpe, hay, 200, record=1000001, digits=digits, depth=depth)
    k = round(depth * 200)
    cue = ACCESS_CUE.format(record=1000001)
    assert trial.needle_at == 1 + k
    assert trial.tokens.tolist() == expected_layout(bpe, hay, 200, cue, [bpe.encode(f" {d}") for d in digits], k)
    assert len(trial.tokens) == len(build_needle(bpe, hay, 200, record=1000001, digits=digits).tokens)


def test_passkey_cue_and_the_control_sequence():
    tok = ByteTokenizer()
    hay = FillerHaystack(tok).tokens(0, 300)
    trial = build_needle(tok, hay, 120, record=1234567, digits=(9, 8, 7, 6, 5), variant="passkey", depth=0.5)
    block = list(b" The pass key is 9 8 7 6 5")
    assert PASSKEY_CUE == " The pass key is"
    assert trial.tokens.tolist() == [256] + list(hay[:60]) + block + list(hay[60:120]) + block
    # Control: the needle removed, the haystack continued by as many tokens; same length, same query.
    assert len(trial.control) == len(trial.tokens)
    assert trial.control.tolist() == [256] + list(hay[: 120 + len(block)]) + block
    assert np.array_equal(trial.control[trial.targets], trial.tokens[trial.targets])


def test_trial_values_are_seeded_and_shaped():
    record, digits = sample_needle(0, 3)
    assert (record, digits) == sample_needle(0, 3) and (record, digits) != sample_needle(1, 3)
    assert 10**6 <= record < 10**7 and len(digits) == 5 and all(0 <= d <= 9 for d in digits)


class SplitDigits(ByteTokenizer):
    """Writes '3' as two tokens: no single token to score."""

    name = "split-digits"

    def encode(self, text):
        return [t for b in text.encode() for t in ((51, 51) if b == 51 else (b,))]


def test_digits_that_split_raise_with_an_explanation():
    with pytest.raises(EvalInputError, match=r"' 3' encodes to 3 tokens.*one greedy prediction per digit"):
        digit_tokens(SplitDigits())


def test_haystack_too_short_for_the_control_raises():
    tok = ByteTokenizer()
    with pytest.raises(EvalInputError, match="control need"):
        build_needle(tok, FillerHaystack(tok).tokens(0, 60), 50, record=1234567, digits=(1, 2, 3, 4, 5))


# ---------------------------------------------------------------------------------------------
# Scoring on hand-made models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_perfect_induction_scores_one_and_the_control_is_uniform(tokenizer, bpe):
    tok = ByteTokenizer() if tokenizer == "byte" else bpe
    vocab = tok.vocab_size
    r = evaluate_needle(Induction(vocab), tok, FillerHaystack(tok), gap=96, trials=3, depth=0.5)
    assert r.digit_acc == 1.0 and r.exact_acc == 1.0 and r.trials == 3
    assert r.ce < 1e-6
    # Without the needle the model has no guess: zero logits, CE = log(vocab) exactly.
    assert r.control_ce == pytest.approx(math.log(vocab), abs=1e-5)


def test_a_model_that_never_guesses_scores_zero_with_ce_log_vocab():
    tok = ByteTokenizer()
    # Zero logits everywhere: argmax is token 0 (a wrong answer), CE is log(257) at every digit.
    r = evaluate_needle(HandModel(257), tok, FillerHaystack(tok), gap=64, trials=4)
    assert (r.digit_acc, r.exact_acc) == (0.0, 0.0)
    assert r.ce == pytest.approx(math.log(257), abs=1e-5) and r.control_ce == pytest.approx(math.log(257), abs=1e-5)


def test_score_batch_computes_logits_only_at_the_asked_positions():
    model = Induction(257)
    tokens = torch.tensor([list(b"abcdefghXabcdefghY")])  # after 'abcdefgh' the second time: 'X'
    pred, ce = score_batch(model, tokens, torch.tensor([[16, 3]]), torch.tensor([[ord("X"), ord("e")]]))
    assert pred.tolist() == [[ord("X"), 0]]
    assert ce[0, 0] < 1e-6 and ce[0, 1] == pytest.approx(math.log(257), abs=1e-5)


def test_right_padding_does_not_change_a_causal_model():
    torch.manual_seed(0)
    model = ATMA(FLAVORS["debug"])  # default-initialised weights: outputs depend on the input
    a, b = torch.randint(0, 256, (1, 90)), torch.randint(0, 256, (1, 60))
    padded = torch.cat([a, torch.cat([b, torch.full((1, 30), 256)], dim=1)])
    positions, targets = torch.tensor([[10, 59], [10, 59]]), torch.tensor([[1, 2], [3, 4]])
    _, ce_batch = score_batch(model, padded, positions, targets)
    _, ce_a = score_batch(model, a, positions[:1], targets[:1])
    _, ce_b = score_batch(model, b, positions[1:], targets[1:])
    assert torch.allclose(ce_batch, torch.cat([ce_a, ce_b]), atol=1e-5)
    assert model.training  # the evaluation restored the mode


def test_quick_needle_on_the_debug_model():
    model = ATMA(FLAVORS["debug"])
    out = quick_needle(model, ByteTokenizer(), gaps=(64, 128), trials=2)
    assert set(out) == {"needle_acc@64", "needle_ce@64", "needle_acc@128", "needle_ce@128"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.values())


def test_run_needle_covers_variants_depths_and_gaps(bpe):
    lines = []
    results = run_needle(
        Induction(bpe.vocab_size),
        bpe,
        FillerHaystack(bpe),
        gaps=[32, 64],
        depths=[0, 0.5],
        variants=["access", "passkey"],
        trials=2,
        progress=lines.append,
    )
    assert [(r.variant, r.depth, r.gap) for r in results] == [
        (v, d, g) for v in ("access", "passkey") for d in (0.0, 0.5) for g in (32, 64)
    ]
    assert len(lines) == 8 and all(r.digit_acc == 1.0 for r in results)


# ---------------------------------------------------------------------------------------------
# Length curve
# ---------------------------------------------------------------------------------------------


class Successor(HandModel):
    """Predicts x+1 (mod V) with logit a_t = 0.01 t at position t: loss_t = log(e^a_t + V - 1) - a_t."""

    def trunk(self, tokens):
        T = tokens.shape[1]
        a = 0.01 * torch.arange(T, dtype=torch.float32)
        h = torch.zeros(*tokens.shape, self.vocab)
        h.scatter_(2, ((tokens + 1) % self.vocab).unsqueeze(-1), a.expand_as(tokens).unsqueeze(-1).contiguous())
        return h, None


def successor_losses(T: int, V: int) -> np.ndarray:
    a = 0.01 * np.arange(T - 1)
    return np.log(np.exp(a) + V - 1) - a


def test_token_losses_in_head_chunks_match_the_closed_form():
    V, T = 50, 300
    seqs = torch.stack([(torch.arange(T) + s) % V for s in range(3)])
    want = successor_losses(T, V)
    for chunk in (7, 4096):
        got = token_losses(Successor(V), seqs, head_chunk=chunk)
        assert got.shape == (3, T - 1)
        np.testing.assert_allclose(got.numpy(), np.broadcast_to(want, (3, T - 1)), rtol=1e-5)


def test_length_curve_is_the_mean_of_the_first_l_minus_1_losses():
    V, lengths = 50, [16, 64, 256]
    seqs = [(np.arange(300) + s) % V for s in range(4)]
    lines = []
    curve = length_curve(Successor(V), seqs, lengths, head_chunk=32, batch_tokens=512, progress=lines.append)
    losses = successor_losses(256, V)
    assert curve.lengths == lengths and curve.documents == 4 and len(lines) == 2  # 2 documents per batch
    np.testing.assert_allclose(curve.nll, [losses[: n - 1].mean() for n in lengths], rtol=1e-5)
    assert curve.nll[0] > curve.nll[1] > curve.nll[2]  # the later tokens are easier here
    assert nested_prefix_nll(np.ones((2, 9)), [2, 10]) == [1.0, 1.0]


# ---------------------------------------------------------------------------------------------
# Long documents
# ---------------------------------------------------------------------------------------------


def list_corpus(docs: list[list[int]], eot: int = 0) -> TokenCorpus:
    def open_(lo, hi):
        return (np.asarray(d[:hi]) if len(d) >= lo else np.empty(0, dtype=np.int64) for d in docs)

    return TokenCorpus("test documents", open_, eot)


def test_long_documents_skip_short_ones_and_explain_when_none_is_long_enough():
    docs = [[1] * 10, [2] * 100, [3] * 50, [4] * 200]
    long = LongDocuments(list_corpus(docs), min_tokens=40, max_tokens=150)
    assert long.get(0, 40)[0] == 2 and long.get(1, 40)[0] == 3 and long.get(2, 40)[0] == 4
    assert long.get(0, 150).tolist() == [4] * 150  # cut to max_tokens
    with pytest.raises(EvalInputError, match=r"only 1 document\(s\) of at least 150 tokens.*--allow-concat"):
        long.get(1, 150)
    joined = LongDocuments(list_corpus(docs), min_tokens=40, max_tokens=150, allow_concat=True)
    assert joined.get(0, 15).tolist() == [1] * 10 + [0] + [2] * 4  # documents joined with EOT
    seqs = length_sequences(LongDocuments(list_corpus(docs), min_tokens=99, max_tokens=99), 0, 100, 2)
    assert [s.tolist() for s in seqs] == [[0] + [2] * 99, [0] + [4] * 99]


def test_shard_documents_split_at_eot_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "_SHARD_CHUNK", 16)  # documents cross many read chunks
    eot, lengths = 99, [5, 40, 0, 12, 70]
    stream, docs = [], []
    for i, n in enumerate(lengths):
        doc = [(i * 7 + j) % 90 for j in range(n)]
        stream += [eot] + doc
        docs.append(doc)
    write_shard(str(tmp_path / "a.bin"), np.array(stream[:50]))
    write_shard(str(tmp_path / "b.bin"), np.array(stream[50:]))
    shards = BinShards(str(tmp_path / "*.bin"))
    got = [d.tolist() for d in shard_documents(shards, eot, 0, 1000)]
    assert got == [d for d in docs if d]
    got = [d.tolist() for d in shard_documents(shards, eot, 10, 30)]
    assert got == [[], docs[1][:30], docs[3], docs[4][:30]]  # short ones come empty (scanned, not kept)


def test_text_documents_as_haystacks(tmp_path):
    from atma_titan.data.documents import TextFiles

    texts = ["short one", FILLER * 3, "tiny", FILLER * 6]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = ByteTokenizer()
    source = TextFiles(str(tmp_path / "docs.jsonl"))
    assert len(list(text_documents(source, tok, 0, 10_000))) == 4  # one pass, then it stops
    corpus = TokenCorpus("docs", lambda lo, hi: text_documents(source, tok, lo, hi), tok.eot_id)
    hay = DocumentHaystack(LongDocuments(corpus, min_tokens=200, max_tokens=500))
    assert bytes(hay.tokens(0, 200)[:200].tolist()) == (FILLER * 3).encode()[:200]
    assert bytes(hay.tokens(1, 200)[:500].tolist()) == (FILLER * 6).encode()[:500]  # 2nd of >= 200 tokens
    assert bytes(hay.tokens(0, 500)[:500].tolist()) == (FILLER * 6).encode()[:500]  # 1st of >= 500 tokens
    with pytest.raises(EvalInputError, match=r"only 1 document\(s\) of at least 500 tokens in the 4 scanned"):
        hay.tokens(1, 500)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fake_results(name: str, shift: float) -> dict:
    needle = [
        {
            "variant": v,
            "gap": g,
            "depth": d,
            "trials": 2,
            "digit_acc": 0.9 - shift,
            "exact_acc": 0.5,
            "ce": 0.3,
            "control_ce": 2.3,
            "mode": "teacher_forced",
        }
        for v in ("access", "passkey")
        for d in (0.0, 0.5)
        for g in (2048, 4096, 65536)
    ]
    curve = {"lengths": [2048, 4096, 65536], "nll": [2.7 + shift, 2.5, 2.0], "documents": 8}
    return {"name": name, "checkpoint": "x", "step": 10, "tokenizer": "gpt2", "needle": needle, "length_curve": curve}


def test_report_files_and_multi_model_plots(tmp_path):
    written = write_results(fake_results("polar+mem", 0.0), tmp_path / "one")
    assert {p.name for p in written.values()} == {"results.json", "results.md", "needle.png", "length_curve.png"}
    md = (tmp_path / "one" / "results.md").read_text()
    assert "| variant | depth | 2K | 4K | 64K |" in md and "| access | 50% | 90.0 | 90.0 | 90.0 |" in md
    assert "| 64K | 2.0000 |" in md
    both = {"a": fake_results("a", 0.0), "b": fake_results("b", 0.2)}
    for plot, name in ((plot_needle, "n.png"), (plot_length_curves, "l.png")):
        path = plot(both, tmp_path / name)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_with_generated_rows_and_old_rows_without_a_mode(tmp_path):
    results = fake_results("m", 0.0)
    for e in results["needle"]:
        del e["mode"]  # an old results.json: teacher-forced
    generated = [
        {**e, "mode": "generated", "digit_acc": 0.4, "ce": None, "control_ce": None}
        for e in fake_results("m", 0.0)["needle"]
    ]
    results["needle"] += generated
    written = write_results(results, tmp_path)
    md = (tmp_path / "results.md").read_text()
    tf = md.index("## Induction needle (teacher-forced)")
    gen = md.index("## Induction needle (generated, greedy free-running)")
    assert tf < gen and "| access | 50% | 90.0 | 90.0 | 90.0 |" in md[tf:gen]
    assert "| access | 50% | 40.0 | 40.0 | 40.0 |" in md[gen:]
    assert "| passkey | 50% | 64K | 2 | 50.0 | 40.0 |\n" in md[gen:] + "\n"  # no CE cells
    assert written["needle_plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    only = {"name": "g", "checkpoint": "x", "step": 1, "tokenizer": "byte", "needle": generated, "length_curve": None}
    both = {"tf": fake_results("tf", 0.0), "gen": only}
    assert plot_needle(both, tmp_path / "both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cells(md: str, heading: str) -> list[list[str]]:
    """The body rows of the first table after `heading` in a markdown text."""
    lines = md[md.index(heading) :].split("\n\n")[1].splitlines()
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_tables_are_in_percent_and_name_the_training_multiple():
    results = {**fake_results("m", 0.0), "train_seq_len": 2048}
    results["needle"][0] = {**results["needle"][0], "digit_acc": 0.875, "exact_acc": 0.40625}  # access, 0, 2K
    md = results_markdown(results)
    assert "trained at seq_len 2048" in md and "Accuracies in percent" in md
    exact = _cells(md, "exact 5/5 recall (% of trials) by gap")
    digit = _cells(md, "per-digit accuracy (% of digits) by gap")
    assert "| variant | depth | 2K (1x) | 4K (2x) | 64K (32x) |" in md
    assert exact[0] == ["access", "before haystack", "40.6", "50.0", "50.0"]
    assert digit[0] == ["access", "before haystack", "87.5", "90.0", "90.0"]
    detail = _cells(md, "### Every condition")
    assert "| exact 5/5 (%) | per-digit acc (%) | CE (nats) | control CE (nats) |" in md
    assert detail[0] == ["access", "before haystack", "2K", "2", "40.6", "87.5", "0.300", "2.300"]
    # Every accuracy cell of every table is a percent (0-100, one decimal), none a fraction like 0.900.
    for row in exact + digit:
        assert all(re.fullmatch(r"\d{1,3}\.\d", c) and float(c) >= 1 for c in row[2:])
    assert all(re.fullmatch(r"\d{1,3}\.\d", c) for row in detail for c in row[4:6])


def test_needle_plot_has_exact_and_per_digit_panels_the_training_length_and_log2_gap_labels(tmp_path):
    a, b = fake_results("a", 0.0), fake_results("b", 0.0)  # the same numbers: lines that coincide
    for r in (a, b):
        r["train_seq_len"] = 4096
        r["needle"] = [e for e in r["needle"] if e["variant"] == "access"]
    panels = needle_panels({"a": a, "b": b})
    assert [p.ylabel for p in panels] == ["exact recall (% of trials)", "per-digit accuracy (% of digits)"]
    assert [s.label for s in panels[0].series] == ["a depth before haystack", "a depth 50%", "b depth before haystack",
                                                   "b depth 50%"]  # fmt: skip
    assert all(s.x == [2048, 4096, 65536] and s.y == [50.0] * 3 for s in panels[0].series)  # exact, in %
    assert all(s.y == pytest.approx([90.0] * 3) for s in panels[1].series)  # per digit, in %

    fig = needle_figure({"a": a, "b": b})
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == ["exact recall: the whole value right", "per-digit accuracy"]
    for ax, panel in zip(axes, panels):
        assert ax.get_xscale() == "log" and ax.get_ylim() == (-3, 103)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["2K", "4K", "64K"]
        lines = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
        assert [line.get_label() for line in lines] == [s.label for s in panel.series]
        assert list(lines[0].get_ydata()) == panel.series[0].y and all(line.get_marker() != "None" for line in lines)
        # Coinciding series are dodged apart on x (same y), each by less than a quarter octave.
        xs = [tuple(line.get_xdata()) for line in lines]
        assert len(set(xs)) == len(xs)
        assert all(abs(math.log2(x / g)) < 0.25 for row in xs for x, g in zip(row, [2048, 4096, 65536]))
        marks = [line for line in ax.get_lines() if list(line.get_xdata()) == [4096, 4096]]
        assert len(marks) == 1 and marks[0].get_linestyle() == ":"
        assert [t.get_text() for t in ax.texts] == ["trained at 4K"]
    assert fig.legends and [t.get_text() for t in fig.legends[0].get_texts()] == [s.label for s in panels[0].series]
    # No training length known (an older results.json), or one given by the caller.
    del a["train_seq_len"], b["train_seq_len"]
    assert not needle_figure({"a": a}).get_axes()[0].texts
    assert [t.get_text() for t in needle_figure({"a": a}, train_len=128).get_axes()[0].texts] == ["trained at 128"]
    assert plot_needle({"a": a, "b": b}, tmp_path / "n.png", train_len=2048).stat().st_size > 0


def test_dodge_is_centred_and_its_spread_capped():
    assert dodge_factors(1) == [1.0]
    three = dodge_factors(3)
    assert three[1] == 1.0 and three[0] * three[2] == pytest.approx(1.0) and three[0] < 1 < three[2]
    many = dodge_factors(40)
    assert math.log2(many[-1] / many[0]) == pytest.approx(0.45) and len(set(many)) == 40


def _written_results(tmp_path, name: str, results: dict) -> Path:
    write_results(results, tmp_path / name)
    return tmp_path / name


def test_compare_puts_the_models_in_one_table_and_one_figure(tmp_path):
    a = {**fake_results("polar", 0.0), "train_seq_len": 2048}
    b = {**fake_results("softmax", 0.2), "train_seq_len": 2048}
    b["needle"][0] = {**b["needle"][0], "exact_acc": 0.125}  # access, depth 0, 2K
    folder = _written_results(tmp_path, "a", a)
    assert compare_main([str(folder), str(_written_results(tmp_path, "b", b) / "results.json"),
                         "--out", str(tmp_path / "cmp")]) == 0  # fmt: skip
    md = (tmp_path / "cmp" / "results.md").read_text()
    exact = _cells(md, "exact recall (% of trials) by gap")
    assert "| model | variant | depth | mode | 2K (1x) | 4K (2x) | 64K (32x) |" in md
    assert exact[0] == ["polar", "access", "before haystack", "teacher-forced", "50.0", "50.0", "50.0"]
    assert ["softmax", "access", "before haystack", "teacher-forced", "12.5", "50.0", "50.0"] in exact
    digit = _cells(md, "per-token accuracy (%) by gap")
    assert ["softmax", "passkey", "50%", "teacher-forced", "70.0", "70.0", "70.0"] in digit
    # The same numbers as each model's own results.md (one unit, percent, one decimal).
    own = _cells((tmp_path / "b" / "results.md").read_text(), "exact 5/5 recall (% of trials) by gap")
    assert own[0][2:] == exact[len(exact) // 2][4:]
    assert "| softmax | 8 | 2.9000 | 2.5000 | 2.0000 |" in md  # the length curves
    for png in ("needle.png", "length_curve.png"):
        assert (tmp_path / "cmp" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_labels_and_bad_input(tmp_path, capsys):
    a = _written_results(tmp_path, "a", fake_results("same", 0.0))
    b = _written_results(tmp_path, "b", fake_results("same", 0.1))
    out = str(tmp_path / "cmp")
    assert compare_main([str(a), str(b), "--out", out]) == 2
    assert "two results are named 'same'" in capsys.readouterr().err
    assert compare_main([str(a), str(b), "--names", "A,B", "--out", out]) == 0
    assert "| A | access |" in (tmp_path / "cmp" / "results.md").read_text()
    assert compare_main([str(a), str(b), "--names", "A", "--out", out]) == 2
    assert "--names has 1 label(s) for 2 results file(s)" in capsys.readouterr().err
    assert compare_main([str(a), str(b), "--names", "A,", "--out", out]) == 2
    assert "--names 'A,' has an empty label" in capsys.readouterr().err
    assert compare_main([str(tmp_path / "nowhere"), "--out", out]) == 2
    assert "nowhere: no such file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert compare_main([str(tmp_path / "bad.json"), "--out", out]) == 2
    assert "bad.json: not a readable results.json" in capsys.readouterr().err
    (tmp_path / "empty.json").write_text(json.dumps({"name": "e", "needle": [], "length_curve": None}))
    assert compare_main([str(tmp_path / "empty.json"), "--out", out]) == 2
    assert "nothing to compare" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The command, end to end on a debug checkpoint
# ---------------------------------------------------------------------------------------------




# A quick needle + length curve: two gaps, two lengths, two trials / documents each.
SMALL_EVAL = ["--gaps", "64,128", "--trials", "2", "--length-curve", "--lengths", "64,128", "--documents", "2"]




def check_schema(results: dict, gaps, depths, variants, lengths, mode="teacher_forced") -> None:
    keys = {"name", "checkpoint", "step", "tokenizer", "train_seq_len", "units", "needle", "length_curve"}
    assert set(results) == keys
    assert results["units"] == RESULT_UNITS and results["train_seq_len"] == 32  # EVAL_TRAIN's training.seq_len
    assert isinstance(results["name"], str) and isinstance(results["checkpoint"], str)
    assert results["tokenizer"] == "byte"
    keys = {"variant", "gap", "depth", "trials", "digit_acc", "exact_acc", "ce", "control_ce", "mode"}
    assert [(e["variant"], e["depth"], e["gap"]) for e in results["needle"]] == [
        (v, d, g) for v in variants for d in depths for g in gaps
    ]
    for e in results["needle"]:
        assert set(e) == keys and isinstance(e["gap"], int) and isinstance(e["depth"], float)
        assert e["mode"] == mode and all(isinstance(e[k], float) for k in ("digit_acc", "exact_acc"))
        if mode == "generated":  # no CE and no control when the model writes the value itself
            assert e["ce"] is None and e["control_ce"] is None
        else:
            assert isinstance(e["ce"], float) and isinstance(e["control_ce"], float)
    if lengths is None:
        assert results["length_curve"] is None
        return
    curve = results["length_curve"]
    assert set(curve) == {"lengths", "nll", "documents"} and curve["lengths"] == lengths
    assert len(curve["nll"]) == len(lengths) and all(isinstance(v, float) for v in curve["nll"])


def test_command_on_the_run_folder_dcp(run_dir):
    proc = run_eval(
        "--checkpoint",
        str(run_dir),
        *SMALL_EVAL,
        "--depths",
        "0,0.5",
        "--passkey",
    )
    assert proc.returncode == 0, proc.stderr
    assert "needle access  gap   128" in proc.stdout and "length curve" in proc.stdout
    out = run_dir / "eval"
    results = json.loads((out / "results.json").read_text())
    check_schema(results, [64, 128], [0.0, 0.5], ["access", "passkey"], [64, 128])
    assert results["step"] == 2 and results["checkpoint"].endswith("step-2") and results["name"] == run_dir.name
    for name in ("results.md", "needle.png", "length_curve.png"):
        assert (out / name).stat().st_size > 0


def test_command_on_the_exported_safetensors(run_dir, tmp_path):
    out = tmp_path / "st"
    proc = run_eval(
        "--checkpoint",
        str(run_dir / "model.safetensors"),
        *SMALL_EVAL,
        "--haystack",
        "data",
        "--out",
        str(out),
        "--name",
        "debug-st",
        "--attention-block",
        "256",  # another tile of the Polar reference: the same numbers
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    check_schema(results, [64, 128], [0.0], ["access"], [64, 128])
    assert results["name"] == "debug-st" and results["step"] == 2  # from the run's DONE marker
    # The same weights as the DCP checkpoint of the last step: the same numbers.
    dcp = json.loads((run_dir / "eval" / "results.json").read_text()) if (run_dir / "eval").exists() else None
    if dcp is not None:
        assert results["length_curve"]["nll"] == pytest.approx(dcp["length_curve"]["nll"], rel=1e-5)
    for name in ("results.md", "needle.png", "length_curve.png"):
        assert (out / name).is_file()


def test_command_generate_on_the_text_needle(run_dir, tmp_path):
    out = tmp_path / "gen"
    proc = run_eval(
        "--checkpoint", str(run_dir), "--text-needle", "--gaps", "64,128", "--trials", "3", "--depths", "0,0.5",
        "--generate", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "needle (generated, greedy free-running): 1 variant(s)" in proc.stdout
    assert re.search(
        r"needle access  gap   128 depth 0\.50 generated: digit acc [0-9.]+%, exact [0-9.]+% \(", proc.stdout
    )
    results = json.loads((out / "results.json").read_text())
    check_schema(results, [64, 128], [0.0, 0.5], ["access"], None, mode="generated")
    md = (out / "results.md").read_text()
    assert "## Induction needle (generated, greedy free-running)" in md and "teacher-forced" not in md
    assert "| variant | depth | gap | trials | exact 5/5 (%) | per-digit acc (%) |\n" in md  # no CE columns
    assert (out / "needle.png").stat().st_size > 0


def test_command_generate_on_the_records_needle(run_dir, tmp_path):
    out = tmp_path / "gen-records"
    proc = run_eval("--checkpoint", str(run_dir), "--records", "--gaps", "256", "--trials", "4", "--generate",
                    "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((out / "results.json").read_text())["needle"]
    assert [(r["variant"], r["gap"], r["trials"], r["mode"]) for r in rows] == [("records", 256, 4, "generated")]
    assert rows[0]["ce"] is None and rows[0]["control_ce"] is None and 0 <= rows[0]["digit_acc"] <= 1


def test_generate_without_the_needle_is_bad_input(run_dir, capsys):
    args = ["--checkpoint", str(run_dir), "--no-needle", "--length-curve", "--generate"]
    assert eval_main(args) == 2
    assert "--generate scores the needle" in capsys.readouterr().err


def test_checkpoint_paths_resolve(run_dir):
    assert resolve_checkpoint(run_dir).path == run_dir / "checkpoints" / "step-2"
    assert resolve_checkpoint(run_dir / "checkpoints", step=1).path == run_dir / "checkpoints" / "step-1"
    step_dir = resolve_checkpoint(run_dir / "checkpoints" / "step-1")
    assert (step_dir.step, step_dir.run_dir, step_dir.config) == (1, run_dir, run_dir / "config.toml")
    st = resolve_checkpoint(run_dir / "model.safetensors")
    assert (st.kind, st.step, st.config) == ("safetensors", 2, run_dir / "config.toml")
    with pytest.raises(CheckpointError, match="step-7"):
        resolve_checkpoint(run_dir, step=7)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint", "/nonexistent/run"], "does not exist"),
        (["--gaps", "64,100000"], "longer than --max-length 65536"),
        (["--gaps", "64", "--max-length", "32"], "longer than --max-length 32"),
        (["--depths", "1.5"], "in \\[0, 1\\)"),
        (["--lengths", "64,1M", "--length-curve"], "'1M' is not a positive integer"),
    ],
)
def test_bad_input_exits_2_with_a_message(run_dir, capsys, args, message):
    if args[0] != "--checkpoint":
        args = ["--checkpoint", str(run_dir), "--out", str(run_dir / "bad"), "--trials", "1", *args]
    assert eval_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and re.search(message, err), err


def test_bad_checkpoint_folder_and_missing_config_exit_2(tmp_path, run_dir, capsys):
    (tmp_path / "empty").mkdir()
    assert eval_main(["--checkpoint", str(tmp_path / "empty")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    # A run trained without checkpoints: the message says what to change in the training command.
    (tmp_path / "nockpt").mkdir()
    (tmp_path / "nockpt" / "config.toml").write_text((run_dir / "config.toml").read_text())
    (tmp_path / "nockpt" / "DONE").write_text("2\n")
    assert eval_main(["--checkpoint", str(tmp_path / "nockpt")]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.enable = false" in err and "--checkpoint.enable true" in err
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "w.safetensors").write_bytes((run_dir / "model.safetensors").read_bytes())
    assert eval_main(["--checkpoint", str(lone / "w.safetensors")]) == 2
    assert "pass --config" in capsys.readouterr().err
