"""The lm-evaluation-harness adapter and command (atma_titan.lm_eval).

The scores are checked against direct computations with the model: `loglikelihood` against the
log_softmax of the logits over the concatenated tokens, `loglikelihood_rolling` against the eval
command's per-token losses (atma_titan.eval.length.token_losses) on `[EOT] + text`. Generation stops
at its stop strings (a perturbed debug model, so the greedy output is not one repeated token). The
command runs end to end on a local multiple-choice task (a YAML and a jsonl written into tmp_path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import EVAL_TRAIN, perturbed_debug_model

from atma_titan.config import load_config
from atma_titan.utils.errors import InputError
from atma_titan.eval.length import token_losses
from atma_titan.lm_eval import AtmaScorer, generation_settings, register
from atma_titan.lm_eval.__main__ import main, task_metadata

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TASK = "atma_mc_tiny"
DOCS = [
    {"question": "Two plus two is", "choices": [" four", " five", " fish"], "answer": 0},
    {"question": "The sky is", "choices": [" blue", " loud"], "answer": 0},
    {"question": "Water is", "choices": [" dry", " wet"], "answer": 1},
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from atma_titan.train import train

    dump = tmp_path_factory.mktemp("run")
    config = ["--config", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder", str(dump)]
    train(load_config([*config, *EVAL_TRAIN]))
    return dump


class CharTokenizer:
    """One printable character per token id (EOT 256 decodes to nothing), so any tokens a random model writes
    decode to text whose prefixes are the decoded prefixes (bytes could make invalid UTF-8)."""

    name = "chars"
    vocab_size = 257
    eot_id = 256
    alphabet = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0x400, 0x400 + 256 - 95)]

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(ch) for ch in text]

    def decode(self, ids) -> str:
        return "".join(self.alphabet[i] for i in ids if i != self.eot_id)


@pytest.fixture(scope="module")
def scorer():
    """A perturbed debug model (random weights everywhere: distinct, non-degenerate outputs)."""
    model = perturbed_debug_model(vocab_size=CharTokenizer.vocab_size)
    return AtmaScorer(model, CharTokenizer(), max_length=64, batch_size=2, progress=False)


def direct_logprob(model, tokens: list[int], n_continuation: int) -> float:
    """Summed log p of the last n tokens given the ones before, from the full logits of one forward."""
    with torch.no_grad():
        logits = model(torch.tensor(tokens[:-1])[None])[0].float()
    logp = F.log_softmax(logits, dim=-1)[-n_continuation:]
    target = torch.tensor(tokens[-n_continuation:])
    return float(logp.gather(-1, target[:, None]).sum())


def test_loglikelihood_is_the_continuations_summed_log_probability(scorer):
    eot, encode = scorer.eot_id, scorer.tokenizer.encode
    requests = [(d["question"], c) for d in DOCS for c in d["choices"]] + [("", "hello")]
    results = scorer.loglikelihood(requests)
    for (context, continuation), (logp, greedy) in zip(requests, results):
        tokens = [eot] + encode(context) + encode(continuation)
        expected = direct_logprob(scorer.model, tokens, len(encode(continuation)))
        assert logp == pytest.approx(expected, abs=1e-4), (context, continuation)
        assert isinstance(greedy, bool)
    # is_greedy: the continuation the model writes greedily is greedy, a different one is not
    written = scorer.generate_until([("The sky is", {"max_gen_toks": 4})])[0]
    assert scorer.loglikelihood([("The sky is", written)])[0][1] is True
    other = "".join("b" if ch == "a" else "a" for ch in written[:1]) + written[1:]
    assert scorer.loglikelihood([("The sky is", other)])[0][1] is False


def test_a_trailing_space_of_the_context_moves_to_the_continuation(scorer):
    assert scorer.encode_pair("The sky is ", "blue") == scorer.encode_pair("The sky is", " blue")
    assert scorer.loglikelihood([("The sky is ", "blue")]) == scorer.loglikelihood([("The sky is", " blue")])


def test_loglikelihood_rolling_equals_the_eval_commands_nll(scorer):
    text = "The quick brown fox jumps over the lazy dog."  # 44 bytes: one window of max_length 64
    tokens = [scorer.eot_id] + scorer.tokenizer.encode(text)
    nll = float(token_losses(scorer.model, torch.tensor(tokens)[None]).double().sum())
    assert scorer.loglikelihood_rolling([text])[0] == pytest.approx(-nll, abs=1e-4)
    assert scorer.loglikelihood_rolling(["ab", ""]) == [pytest.approx(scorer.loglikelihood([("", "ab")])[0][0]), 0.0]


def test_loglikelihood_rolling_predicts_every_token_of_a_long_text_once(scorer):
    text = "abcdefghij" * 15  # 150 tokens: three windows of at most 64
    tokens = scorer.tokenizer.encode(text)
    windows = scorer.rolling_windows(tokens)
    assert len(windows) == 3 and sum(len(w[1]) for w in windows) == len(tokens)
    expected = sum(direct_logprob(scorer.model, c + p, len(p)) for c, p in windows)
    assert all(len(c) + len(p) - 1 <= 64 for c, p in windows)
    assert scorer.loglikelihood_rolling([text])[0] == pytest.approx(expected, abs=1e-3)


def test_generate_until_stops_at_its_stop_strings(scorer):
    free = scorer.generate_until([("Hello world", {"max_gen_toks": 24})])[0]
    assert len(free) == 24 and len(set(free)) > 3, free  # greedy: the same text every time, not degenerate
    stop = free[10:12]
    stopped, plain = scorer.generate_until(
        [("Hello world", {"until": [stop], "max_gen_toks": 24}), ("Hello world", {"max_gen_toks": 5})]
    )
    assert stopped == free[: free.index(stop)] and stop not in stopped
    assert plain == free[:5]  # max_gen_toks, in a batch with another request
    # greedy unless sampling is asked for
    assert generation_settings({"until": "\n", "temperature": 0.7, "do_sample": False}).sampling.greedy
    assert generation_settings({"until": "\n"}).until == ("\n",)
    sampled = scorer.generate_until([("Hello world", {"max_gen_toks": 24, "temperature": 1.5})])[0]
    assert sampled != free


def test_bad_generation_settings_are_refused(scorer):
    with pytest.raises(InputError, match="max_gen_toks"):
        generation_settings({"max_gen_toks": 0})
    with pytest.raises(InputError, match="leaves no room"):
        scorer.generate_until([("x", {"max_gen_toks": 64})])


def test_adapter_is_registered_and_answers_harness_instances(scorer, run_dir):
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model, model_registry

    cls = register()
    assert get_model("atma_titan") is cls and "hf" in model_registry.keys()  # the harness's own models too
    lm = cls(scorer=scorer)
    request = Instance("loglikelihood", {}, ("The sky is", " blue"), 0)
    assert lm.loglikelihood([request]) == scorer.loglikelihood([("The sky is", " blue")])
    with pytest.raises(InputError, match="checkpoint=PATH"):
        cls()
    # as simple_evaluate(model="atma_titan", model_args="checkpoint=...", batch_size=..., device=...) makes it
    lm = cls.create_from_arg_string(f"checkpoint={run_dir},max_length=64", {"batch_size": 4, "device": "cpu"})
    assert (lm.batch_size, lm.max_length, lm.get_model_info()["step"]) == (4, 64, 2)
    with pytest.raises(InputError, match="batch_size 'auto'"):
        cls.create_from_arg_string(f"checkpoint={run_dir}", {"batch_size": "auto"})
    with pytest.raises(InputError, match="model_args pretrained not understood"):
        cls.create_from_arg_string(f"pretrained={run_dir}")


# ---------------------------------------------------------------------------------------------
# The command


def write_task(folder: Path) -> Path:
    """Three local tasks over one jsonl: multiple choice, generation (stop at a newline) and perplexity."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n{common}"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "atma_gen_tiny.yaml").write_text(
        f"task: atma_gen_tiny\n{common}"
        "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_target: "{{choices[answer]}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "atma_ppl_tiny.yaml").write_text(
        f"task: atma_ppl_tiny\n{common}"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{question}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return folder


@pytest.mark.slow
def test_command_runs_local_tasks_and_writes_results(run_dir, tmp_path, capsys, monkeypatch):
    from atma_titan.checkpoint.open import load_eval_model, open_checkpoint

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    tasks, out = write_task(tmp_path / "tasks"), tmp_path / "out"
    argv = ["--checkpoint", str(run_dir), "--tasks", "atma_*", "--include-path", str(tasks), "--no-builtin-tasks"]
    assert main([*argv, "--limit", "2", "--batch-size", "3", "--out", str(out), "--log-samples"]) == 0
    printed = capsys.readouterr().out
    assert TASK in printed and "acc" in printed and "|" in printed  # the harness's table
    results = json.loads((out / "results.json").read_text())
    assert set(results["results"]) == {TASK, "atma_gen_tiny", "atma_ppl_tiny"}
    assert 0 <= results["results"][TASK]["acc,none"] <= 1
    assert results["config"]["step"] == 2 and results["config"]["max_length"] == 32  # the run's training.seq_len
    samples = {t: [json.loads(line) for line in (out / f"samples_{t}.jsonl").open()] for t in results["results"]}
    assert all(len(rows) == 2 for rows in samples.values())  # --limit
    assert all("\n" not in row["filtered_resps"][0] for row in samples["atma_gen_tiny"])  # until: ["\n"]
    # the harness's rolling log-likelihood is the eval command's summed NLL of [EOT] + text
    opened = open_checkpoint(run_dir)
    model = load_eval_model(opened.model_args, opened.resolved, torch.device("cpu"))
    for row in samples["atma_ppl_tiny"]:
        tokens = [opened.tokenizer.eot_id] + opened.tokenizer.encode(row["doc"]["question"])
        nll = float(token_losses(model, torch.tensor(tokens)[None]).double().sum())
        assert row["filtered_resps"][0] == pytest.approx(-nll, abs=1e-4)


def test_command_bad_input_exits_2(run_dir, tmp_path, capsys):
    tasks = write_task(tmp_path / "tasks")
    local = ["--include-path", str(tasks), "--no-builtin-tasks"]
    assert main(["--checkpoint", str(run_dir), "--tasks", "atma_mc_tiyn", *local]) == 2
    err = capsys.readouterr().err
    assert "unknown task(s): 'atma_mc_tiyn' (close matches: atma_mc_tiny," in err and "Traceback" not in err
    assert main(["--checkpoint", str(tmp_path / "nowhere"), "--tasks", TASK, *local]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--checkpoint", str(run_dir), "--tasks", TASK, "--no-builtin-tasks"]) == 2
    assert "--include-path" in capsys.readouterr().err
    assert main(["--checkpoint", str(run_dir), "--tasks", TASK, *local, "--metadata", "{nope"]) == 2
    assert "--metadata '{nope' is not JSON" in capsys.readouterr().err


@pytest.mark.slow
def test_an_unknown_task_is_matched_against_the_harness_tasks(run_dir, capsys):
    assert main(["--checkpoint", str(run_dir), "--tasks", "hellaswg"]) == 2  # indexes the ~14,000 built-in tasks
    assert "unknown task(s): 'hellaswg' (close matches: hellaswag" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Task data offline: the cache at once, or one line and exit 2


def write_hub_task(folder: Path) -> Path:
    """A task over a Hub data set that no cache holds."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "atma_hub_tiny.yaml").write_text(
        "task: atma_hub_tiny\ndataset_path: atma-titan-tests/no-such-data\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )
    return folder


def test_missing_task_data_offline_is_one_line_and_exit_2(run_dir, tmp_path, monkeypatch, capsys):
    import logging

    import lm_eval.utils

    # lm_eval logs through a handler it makes once, on the stderr of the time (an earlier test's capture)
    monkeypatch.setattr(logging.getLogger("lm_eval"), "handlers", [])
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = write_hub_task(tmp_path / "tasks")
    began = time.perf_counter()
    argv = ["--checkpoint", str(run_dir), "--tasks", "atma_hub_tiny", "--include-path", str(tasks)]
    assert main([*argv, "--no-builtin-tasks", "--out", str(tmp_path / "out")]) == 2
    assert time.perf_counter() - began < 30  # no retries of the Hub
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and err.rstrip().endswith(line)
    assert line.startswith(
        "error: task 'atma_hub_tiny' needs the Hugging Face data set 'atma-titan-tests/no-such-data', which is not "
        "in the local cache ("
    )
    assert "HF_HUB_OFFLINE=1 is set. Run this command once online without HF_HUB_OFFLINE to fetch it" in line
    assert line.endswith("or write the task as a YAML over local files and pass --include-path DIR")


@pytest.mark.slow
def test_a_builtin_task_with_no_network_fails_at_once_in_one_line(run_dir, tmp_path):
    """The command as a user runs it, with nothing answering at the Hub's address and an empty cache."""
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_OFFLINE", "_proxy", "_PROXY"))}
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}  # port 9: nothing listens
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "atma_titan.lm_eval", "--checkpoint", str(run_dir), "--tasks", "lambada_openai"]
    began = time.perf_counter()
    proc = subprocess.run([*command, "--limit", "1"], env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - began
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Retry" not in proc.stderr, proc.stderr[-3000:]
    assert "the Hugging Face Hub cannot be reached (127.0.0.1:9: " in proc.stdout
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith(
        "error: task 'lambada_openai' needs the Hugging Face data set 'EleutherAI/lambada_openai', which is not in "
        f"the local cache ({tmp_path / 'hf'}), and the Hub cannot be reached (127.0.0.1:9: "
    )
    assert "Run this command once online to fetch it" in last and "--include-path DIR" in last
    assert seconds < 120  # indexing the built-in tasks and loading the model: no waiting on the network


def test_the_hub_probe_and_offline_mode(monkeypatch):
    import socket

    import datasets
    import huggingface_hub.constants

    from atma_titan.lm_eval.offline import hub_or_cache, missing_task_data, offline_mode, unreachable

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        monkeypatch.setenv("HF_ENDPOINT", f"https://127.0.0.1:{port}")
        assert unreachable() is None
        with hub_or_cache() as offline:
            assert offline is None and not huggingface_hub.constants.HF_HUB_OFFLINE
    assert unreachable().startswith(f"127.0.0.1:{port}: ")  # closed now: refused
    before = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    with offline_mode():
        assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE
        assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == before
    assert "HF_DATASETS_OFFLINE" not in os.environ
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # the user's choice: online, not probed
    with hub_or_cache() as offline:
        assert offline is None
    assert missing_task_data(ValueError("not the network"), None) is None
    assert missing_task_data(ConnectionError("raised outside a task's data loading"), None) is None


def test_ruler_metadata_names_the_runs_hub_tokenizer():
    assert task_metadata(None, "hf:Qwen/Qwen3-0.6B") == {"tokenizer": "Qwen/Qwen3-0.6B"}
    assert task_metadata('{"tokenizer": "gpt2", "max_seq_lengths": [64]}', "hf:x/y") == {
        "tokenizer": "gpt2",
        "max_seq_lengths": [64],
    }
    assert task_metadata(None, "byte") == {}


def test_command_without_the_harness_names_the_extra(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert main(["--checkpoint", str(run_dir), "--tasks", TASK]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'atma_titan[lm_eval]'" in err and "\n" not in err


# ---------------------------------------------------------------------------------------------
# The exported Hugging Face folder in the harness's own "hf" model


def tiny_tokenizer_json(folder: Path) -> Path:
    """A byte-level BPE of 288 tokens (<= the debug model's 512) with <|endoftext|>, trained on the task's text."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([d["question"] + "".join(d["choices"]) for d in DOCS] * 10, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.mark.slow
def test_exported_hf_folder_scores_the_same_in_the_harness_hf_model(tmp_path, monkeypatch):
    """`lm_eval run --model hf --model_args pretrained=DIR,trust_remote_code=True` on the exported folder
    gives the rolling log-likelihoods this adapter gives on the checkpoint it was exported from."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the harness's hf model needs it (lm-eval[hf])
    export = pytest.importorskip("atma_titan.export")
    from atma_titan.train import train

    run, hf_dir, tasks = tmp_path / "run", tmp_path / "hf", write_task(tmp_path / "tasks")
    tokenizer = tiny_tokenizer_json(tmp_path / "tok")
    config = ["--config", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder", str(run)]
    train(load_config([*config, "--data.tokenizer", str(tokenizer), *EVAL_TRAIN]))
    assert export.main(["--checkpoint", str(run), "--out", str(hf_dir)]) == 0

    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    harness_out = tmp_path / "harness"
    proc = subprocess.run(
        [
            sys.executable, "-m", "lm_eval", "run", "--model", "hf",
            "--model_args", f"pretrained={hf_dir},trust_remote_code=True", "--tasks", "atma_ppl_tiny",
            "--include_path", str(tasks), "--limit", "2", "--device", "cpu", "--output_path", str(harness_out),
            "--log_samples",
        ],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "atma_ppl_tiny" in proc.stdout
    (samples,) = harness_out.glob("*/samples_atma_ppl_tiny_*.jsonl")
    theirs = [float(json.loads(line)["filtered_resps"][0]) for line in samples.open()]

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    ours = AtmaScorer.from_checkpoint(run, progress=False).loglikelihood_rolling([d["question"] for d in DOCS[:2]])
    assert theirs == pytest.approx(ours, abs=1e-3)
