"""Generation: the paged cache and state slots, sampling, continuous batching and the command.

The cache is checked against recomputing the full forward for every token (`use_cache=False`):
same logits at every step, for Polar and softmax attention, memory on and off, RoPE and a window.
GPU tests (skipped without CUDA): the decode step replayed from a CUDA graph equals the eager step.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import EVAL_TRAIN, perturbed_debug_model

from atma_titan.config import load_config
from atma_titan.generate import TextStream, main
from atma_titan.inference import CacheFullError, Generator, ModelCache, Request, Sampling, allowed_tokens, sample

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


PROMPTS = [list(range(1, 18)), [5, 6, 7], [300, 2, 9, 41, 8, 8, 7, 100, 3]]


def run(model, requests, **kwargs) -> dict[int, list]:
    """{request index: [events]} of one generate() run."""
    options = dict(max_batch=2, max_context=64, page_size=4, prefill_chunk=5, record_logits=True)
    out: dict[int, list] = {}
    for event in Generator(model, **{**options, **kwargs}).generate(requests):
        out.setdefault(event.index, []).append(event)
    return out


VARIANTS = {
    "polar_memory": dict(attention="polar", memory=True),
    "polar": dict(attention="polar", memory=False),
    "softmax_memory": dict(attention="softmax", memory=True),
    "softmax": dict(attention="softmax", memory=False),
    "rope_window": dict(attention="polar", memory=True, position="rope", canon=False, window=6),
    "softmax_window": dict(attention="softmax", memory=False, window=5),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_matches_full_forward(variant):
    """Prefill in chunks across page boundaries, then decode: every step's logits equal the full forward's."""
    model = perturbed_debug_model(**VARIANTS[variant])
    requests = [Request(p, 12, i) for i, p in enumerate(PROMPTS)]
    cached, full = run(model, requests), run(model, requests, use_cache=False)
    for i in range(len(PROMPTS)):
        assert [e.token for e in cached[i]] == [e.token for e in full[i]]
        for a, b in zip(cached[i], full[i]):
            torch.testing.assert_close(a.logits, b.logits, atol=2e-5, rtol=1e-5)
    # and the full forward is the model's own forward over the generated sequence
    tokens = PROMPTS[0] + [e.token for e in full[0]][:-1]
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0, len(PROMPTS[0]) - 1 :]
    torch.testing.assert_close(torch.stack([e.logits for e in full[0]]), logits, atol=2e-5, rtol=1e-5)


def test_batch_generates_what_each_prompt_generates_alone():
    """Three prompts, two slots (continuous batching: the third waits), equal to each run alone."""
    model = perturbed_debug_model()
    together = run(model, [Request(p, 10, i) for i, p in enumerate(PROMPTS)], max_batch=2)
    for i, prompt in enumerate(PROMPTS):
        alone = run(model, [Request(prompt, 10, i)], max_batch=1)[i]
        assert [e.token for e in together[i]] == [e.token for e in alone]
        torch.testing.assert_close(
            torch.stack([e.logits for e in together[i]]), torch.stack([e.logits for e in alone]), atol=2e-5, rtol=1e-5
        )


def test_greedy_and_seeded_sampling_are_deterministic():
    model = perturbed_debug_model()
    requests = [Request(p, 8, i) for i, p in enumerate(PROMPTS)]
    greedy = [run(model, requests)[i] for i in range(3)]
    assert [[e.token for e in g] for g in greedy] == [
        [e.token for e in g] for g in (run(model, requests)[i] for i in range(3))
    ]
    hot = Sampling(temperature=1.5, top_k=50)
    first = run(model, requests, sampling=hot, seed=3)
    again = run(model, requests, sampling=hot, seed=3)
    other = run(model, requests, sampling=hot, seed=4)
    tokens = lambda out: [[e.token for e in out[i]] for i in range(3)]  # noqa: E731
    assert tokens(first) == tokens(again) and tokens(first) != tokens(other)


def test_eot_stops_a_sequence_and_frees_its_cache():
    model = perturbed_debug_model()
    first = run(model, [Request(PROMPTS[0], 5)])[0][0].token  # the greedy first token: make it the EOT
    engine = Generator(model, max_batch=2, max_context=64, page_size=4, eot_id=first)
    free = engine.cache.free_pages
    events = list(engine.generate([Request(PROMPTS[0], 5, 0), Request(PROMPTS[1], 5, 1)]))
    mine = [e for e in events if e.index == 0]
    assert [(e.token, e.finished) for e in mine] == [(first, "eot")]
    assert [e for e in events if e.index == 1][-1].finished in ("eot", "length")
    assert engine.cache.free_pages == free and len(engine.cache._free_slots) == 2


def test_a_stop_predicate_finishes_a_sequence_and_frees_its_cache():
    model = perturbed_debug_model()
    engine = Generator(model, max_batch=2, max_context=64, page_size=4)
    free = engine.cache.free_pages
    stop_at_three = lambda generated: len(generated) == 3  # noqa: E731
    events = list(engine.generate([Request(PROMPTS[0], 8, 0, stop_at_three), Request(PROMPTS[1], 8, 1)]))
    assert [e.finished for e in events if e.index == 0] == [None, None, "stop"]
    assert [e.finished for e in events if e.index == 1][-1] == "length"
    assert engine.cache.free_pages == free and len(engine.cache._free_slots) == 2


def test_small_pool_runs_prompts_one_after_another():
    """A pool with room for one sequence at a time still finishes every prompt, each as if alone."""
    model = perturbed_debug_model()
    pages = math.ceil((len(PROMPTS[0]) + 6) / 4)
    requests = [Request(p, 6, i) for i, p in enumerate(PROMPTS)]
    narrow = run(model, requests, max_batch=3, num_pages=pages + 1)
    wide = run(model, requests, max_batch=3)
    assert {i: [e.token for e in v] for i, v in narrow.items()} == {i: [e.token for e in v] for i, v in wide.items()}


def test_requests_that_cannot_fit_are_refused_before_any_token():
    model = perturbed_debug_model()
    engine = Generator(model, max_batch=2, max_context=20, page_size=4)
    events = engine.generate([Request([1, 2, 3], 4, 0), Request(list(range(1, 19)), 4, 1)])
    with pytest.raises(CacheFullError, match="prompt 1 .18 tokens . 4 new. needs 22 tokens"):
        next(events)
    with pytest.raises(CacheFullError, match="pages"):
        ModelCache(model.args, max_seqs=1, max_context=64, page_size=4, num_pages=3).check_fits(20)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        next(engine.generate([Request([1, 100_000], 4, 0)]))


# ---------------------------------------------------------------------------------------------
# Sampling on a hand-made distribution

PROBS = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])


@pytest.mark.parametrize(
    "top_k, top_p, allowed",
    [
        (0, 1.0, {0, 1, 2, 3, 4}),
        (2, 1.0, {0, 1}),
        (0, 0.6, {0, 1}),
        (0, 0.5, {0}),
        (0, 0.86, {0, 1, 2, 3}),
        (3, 0.6, {0, 1}),
    ],
)
def test_top_k_top_p_allow_only_their_tokens(top_k, top_p, allowed):
    logits = PROBS.log()
    assert set(allowed_tokens(logits, top_k, top_p)[0].nonzero().flatten().tolist()) == allowed
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits.expand(4000, -1), Sampling(1.0, top_k, top_p), gen)
    assert set(draws.tolist()) == allowed
    # the kept tokens keep their relative odds
    kept = sorted(allowed)
    expected = PROBS[0, kept] / PROBS[0, kept].sum()
    observed = torch.bincount(draws, minlength=5)[kept].float() / len(draws)
    torch.testing.assert_close(observed, expected, atol=0.03, rtol=0)


def test_greedy_takes_the_argmax_and_bad_settings_are_refused():
    logits = PROBS.log()[:, [3, 0, 1, 2, 4]]
    assert sample(logits, Sampling()).tolist() == [1]
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_text_stream_holds_back_incomplete_characters(capsys):
    import io

    from atma_titan.data.tokenizer import ByteTokenizer

    out = io.StringIO()
    stream = TextStream(ByteTokenizer(), out)
    for byte in "é!".encode():
        stream.add(byte)
        if byte == 0xC3:
            assert out.getvalue() == ""  # half a character: nothing printed yet
    assert out.getvalue() == "é!"


def test_text_stream_shows_ids_without_text():
    import io

    from atma_titan.data.tokenizer import ByteTokenizer

    out = io.StringIO()
    stream = TextStream(ByteTokenizer(), out)
    for token in [ord("a"), 311, 0xE2, 0x82, ord("b"), 256]:
        stream.add(token, final=token == 256)
    assert out.getvalue() == "a<311><226><130>b"


# ---------------------------------------------------------------------------------------------
# The command on a debug checkpoint


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from atma_titan.train import train

    dump = tmp_path_factory.mktemp("run")
    config = ["--config", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder", str(dump)]
    train(load_config([*config, *EVAL_TRAIN]))
    return dump


def test_command_streams_one_prompt(run_dir, capsys):
    assert (
        main(
            ["--checkpoint", str(run_dir), "--prompt", "The access code", "--max-new-tokens", "7", "--temperature", "0"]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "7 tokens in" in err and "finished: length" in err
    assert out.endswith("\n") and len(out) > 1


SYNTHETIC_ID = re.compile(r"<(25[7-9]|2[6-9][0-9]|[34][0-9][0-9]|50[0-9]|51[01])>")  # ids 257-511 of the debug model


def test_command_shows_the_debug_models_ids_and_prints_them_with_show_ids(run_dir, tmp_path, capsys):
    """The debug model writes its synthetic language (ids 257-511, beyond the byte tokenizer): <id>, not U+FFFD."""
    from atma_titan.data.tokenizer import ByteTokenizer, decode_readable

    argv = ["--checkpoint", str(run_dir), "--max-new-tokens", "32", "--temperature", "1", "--top-k", "0"]
    assert main([*argv, "--prompt", "abc", "--show-ids"]) == 0
    text, ids_line = capsys.readouterr().out.rstrip("\n").split("\n")[-2:]
    assert SYNTHETIC_ID.search(text) and "\ufffd" not in text
    assert ids_line.startswith("ids: ")
    ids = [int(i) for i in ids_line.split()[1:]]
    assert len(ids) <= 32 and all(0 <= i < 512 for i in ids) and any(i >= 257 for i in ids)
    assert text == decode_readable(ByteTokenizer(), ids)
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('"abc"\n"xyz"\n')
    assert main([*argv, "--prompts", str(prompts), "--out", str(out), "--show-ids"]) == 0
    for row in map(json.loads, out.read_text().splitlines()):
        assert "\ufffd" not in row["text"] and len(row["ids"]) == row["new_tokens"]
        assert row["text"] == decode_readable(ByteTokenizer(), row["ids"])


def untied_copy(run_dir: Path, folder: Path) -> Path:
    """The run's exported weights with the head's bias jittered. Tokens the 2-step model never saw keep
    exactly equal logits (the zero-initialised head updates them alike), and greedy decoding may break
    such a tie one way with the cache and the other way without it."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    (folder / "config.toml").write_text((run_dir / "config.toml").read_text())
    weights = load_file(run_dir / "model.safetensors")
    weights["head.bias"] += 1e-3 * torch.randn(weights["head.bias"].shape, generator=torch.Generator().manual_seed(0))
    save_file(weights, folder / "model.safetensors")
    return folder / "model.safetensors"


def test_command_writes_one_line_per_prompt_and_no_cache_agrees(run_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello"}\n"abc"\n\n{"prompt": "a longer prompt than the others"}\n')
    weights = untied_copy(run_dir, tmp_path / "run")
    rows = {}
    for flags in ([], ["--no-cache"]):
        out = tmp_path / f"out{len(flags)}.jsonl"
        argv = ["--checkpoint", str(weights), "--prompts", str(prompts), "--out", str(out)]
        assert main([*argv, "--max-new-tokens", "6", "--temperature", "0", "--batch-size", "2", *flags]) == 0
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        rows[len(flags)] = {r["index"]: r for r in lines}
    assert sorted(rows[0]) == [0, 1, 2]
    for i, row in rows[0].items():
        assert row["new_tokens"] <= 6 and row["finish"] in ("eot", "length") and row["seconds"] >= 0
        assert row["prompt_tokens"] == 1 + len(row["prompt"].encode())  # EOT + the bytes
        assert (row["text"], row["new_tokens"]) == (rows[1][i]["text"], rows[1][i]["new_tokens"])
    assert "generated" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--checkpoint", "/no/such/run", "--prompt", "x"], "does not exist"),
        (["--prompt", "x" * 40, "--max-context", "16"], "--max-context is 16"),
        (["--prompts", "/no/such.jsonl"], "no such file"),
        (["--prompt", "x", "--top-p", "0"], "--top-p"),
        (["--prompt", "x", "--page-size", "12"], "--page-size"),
    ],
)
def test_command_bad_input_exits_2(run_dir, argv, message, capsys):
    if "--checkpoint" not in argv:
        argv = ["--checkpoint", str(run_dir), *argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_command_refuses_a_tokenizer_the_model_cannot_read(run_dir, tmp_path, capsys):
    config = tmp_path / "small_vocab.toml"
    text = (run_dir / "config.toml").read_text()
    config.write_text(text.replace("[model]\n", "[model]\nvocab_size = 128\n", 1))
    assert main(["--checkpoint", str(run_dir), "--config", str(config), "--prompt", "x"]) == 2
    assert "tokenizer 'byte' has 257 ids but model.vocab_size is 128" in capsys.readouterr().err


def test_bad_prompts_file_names_the_line(run_dir, tmp_path, capsys):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    assert main(["--checkpoint", str(run_dir), "--prompts", str(prompts)]) == 2
    assert f"{prompts}:2" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("attention", ["polar", "softmax"])
def test_cuda_graph_decode_matches_eager(attention):
    """Replaying the captured decode step (with padding rows) gives the eager step's logits and tokens."""
    model = perturbed_debug_model(torch.device("cuda"), attention=attention)
    requests = [Request(p, 16, i) for i, p in enumerate(PROMPTS)]
    graphed = run(model, requests, max_batch=4, cuda_graphs=True)
    eager = run(model, requests, max_batch=4, cuda_graphs=False)
    for i in range(len(PROMPTS)):
        assert [e.token for e in graphed[i]] == [e.token for e in eager[i]]
        torch.testing.assert_close(
            torch.stack([e.logits for e in graphed[i]]), torch.stack([e.logits for e in eager[i]]), atol=1e-3, rtol=1e-3
        )


@needs_cuda
def test_compiled_cuda_graph_decode_matches_eager():
    model = perturbed_debug_model(torch.device("cuda"))
    requests = [Request(p, 8, i) for i, p in enumerate(PROMPTS)]
    compiled = run(model, requests, max_batch=4, compile=True)
    eager = run(model, requests, max_batch=4, cuda_graphs=False)
    for i in range(len(PROMPTS)):
        a, b = torch.stack([e.logits for e in compiled[i]]), torch.stack([e.logits for e in eager[i]])
        assert (a - b).abs().max() < 0.03 * b.abs().max() + 1e-3


@needs_cuda
def test_cuda_generation_follows_the_full_forward():
    """bf16 on the GPU: each cached step's logits stay within bf16 rounding of the full forward over the
    same tokens (teacher-forced on what the cached run generated)."""
    model = perturbed_debug_model(torch.device("cuda"))
    cached = run(model, [Request(p, 8, i) for i, p in enumerate(PROMPTS)], max_batch=4)
    for i, prompt in enumerate(PROMPTS):
        tokens = prompt + [e.token for e in cached[i]][:-1]
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            full = model(torch.tensor([tokens], device="cuda"))[0, len(prompt) - 1 :].float().cpu()
        ours = torch.stack([e.logits for e in cached[i]])
        assert (ours - full).abs().max() < 0.03 * full.abs().max() + 1e-3


def test_a_decode_step_projects_without_stacking_the_weights(monkeypatch):
    """Stacking a global block's projection weights (layers.fused_linear) pays for prompts and training; a
    decode step reads each weight once as it is, since the stacked copy would be made for every token."""
    from atma_titan.models import attention

    token_counts = []
    real = attention.fused_linear
    record = lambda x, linears: token_counts.append(x.shape[1]) or real(x, linears)  # noqa: E731
    monkeypatch.setattr(attention, "fused_linear", record)
    model = perturbed_debug_model(**VARIANTS["polar_memory"])
    events = run(model, [Request(p, 6, i) for i, p in enumerate(PROMPTS)])  # prefill chunks of 2-5 tokens
    assert sum(len(e) for e in events.values()) == 6 * len(PROMPTS)
    assert token_counts and min(token_counts) > 1
