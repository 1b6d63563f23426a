"""Hugging Face format out and in (atma_titan.hf, python -m atma_titan.export, checkpoint.export_hf / initial_load_hf).

The exported folder loads in a fresh interpreter with AutoModelForCausalLM (trust_remote_code), gives
atma_titan's logits, and its greedy generate() (with and without the cache) is atma_titan.generate's;
a run starts from it at 1 and 2 ranks; eval and generate take it as --checkpoint; bad input exits 2.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed_utils import TINY, losses, run_trainer
from helpers import EVAL_TRAIN, perturbed_debug_model

pytest.importorskip("transformers")

from atma_titan.config import load_config  # noqa: E402
from atma_titan.utils.errors import InputError  # noqa: E402
from atma_titan.checkpoint.open import load_eval_model, open_checkpoint  # noqa: E402
from atma_titan.export import main as export_main  # noqa: E402
from atma_titan.hf.export import export_hf  # noqa: E402
from atma_titan.hf.load import load_hf_weights, read_hf_model_args  # noqa: E402
from atma_titan.hf.modeling import AtmaForCausalLM  # noqa: E402
from atma_titan.hf.tokenizer import TOKENIZER_FILES  # noqa: E402
from atma_titan.inference import Generator, Request  # noqa: E402
from atma_titan.models import build_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEBUG = REPO / "train_configs/debug_model.toml"
EOT = 256
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def debug_cfg(*overrides: str):
    return load_config(["--config", str(DEBUG), *overrides])


def greedy(model, prompt: list[int], new: int, use_cache: bool = True) -> list[int]:
    """atma_titan's greedy tokens, ending at the byte tokenizer's EOT (256) as the folder's generation config does."""
    engine = Generator(model, max_batch=1, max_context=len(prompt) + new, use_cache=use_cache, eot_id=EOT)
    return [e.token for e in engine.generate([Request(prompt, new)])]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step debug run with a DCP checkpoint and the Hugging Face folder <run>/hf/ (checkpoint.export_hf)."""
    from atma_titan.train import train

    dump = tmp_path_factory.mktemp("run")
    config = ["--config", str(DEBUG), "--job.dump_folder", str(dump), *EVAL_TRAIN]
    train(load_config([*config, "--checkpoint.export_hf", "true"]))
    return dump


# ---------------------------------------------------------------------------------------------
# The model: logits, loss, generate


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A perturbed debug model (every block shapes the output), exported, and loaded back as AtmaForCausalLM."""
    model = perturbed_debug_model()
    out = export_hf(model, tmp_path_factory.mktemp("hf") / "model", debug_cfg())
    return model, AtmaForCausalLM.from_pretrained(out).eval()


def test_logits_and_loss_equal_atma(exported):
    model, hf = exported
    ids = torch.randint(0, model.args.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf(ids, labels=ids)
        torch.testing.assert_close(out.logits, model(ids), atol=1e-5, rtol=1e-5)
        expected = F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generate_equals_atma_generate(exported, use_cache):
    """A 3-token prompt and 24 new tokens: the cache (16 tokens at first) grows, copying pages and states."""
    model, hf = exported
    prompt = [5, 300, 7]
    expected = greedy(model, prompt, 24)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, use_cache=use_cache)
    assert out[0, len(prompt) :].tolist() == expected
    assert greedy(model, prompt, 24, use_cache=False) == expected


def test_left_padded_batch_generates_each_row_as_alone(exported):
    model, hf = exported
    prompts = [[5, 300, 7, 9, 11, 2], [42, 8]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    for use_cache in (True, False):
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=use_cache)
        for row, prompt in zip(out, prompts):  # a row that ends at EOT is padded after it
            expected = greedy(model, prompt, 6)
            assert row[width : width + len(expected)].tolist() == expected


# ---------------------------------------------------------------------------------------------
# The folder


def test_folder_holds_config_weights_generation_config_shims_and_card(run_dir):
    folder = run_dir / "hf"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "atma" and config["d_model"] == 128 and config["global_layers"] == [2]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_atma.AtmaForCausalLM"
    assert config["training_step"] == 2
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 256  # byte EOT
    assert "from atma_titan.hf.modeling import AtmaForCausalLM" in (folder / "modeling_atma.py").read_text()
    card = (folder / "README.md").read_text()
    assert "The run's tokenizer ('byte') is in this folder" in card and "AutoTokenizer.from_pretrained(folder" in card
    assert "tokens seen: 256" in card and "final train loss" in card and "[model]" in card
    assert all((folder / name).is_file() for name in TOKENIZER_FILES)


@pytest.mark.slow
def test_fresh_interpreter_loads_the_folder_with_automodel(run_dir):
    """Self-contained given atma_titan installed: AutoModelForCausalLM + trust_remote_code in a new process."""
    script = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "ids = torch.tensor([[1, 2, 3, 4, 5, 6]])\n"
        "with torch.no_grad():\n"
        "    logits = m(ids).logits\n"
        "out = m.generate(ids, max_new_tokens=8, do_sample=False)\n"
        "got = {'cls': type(m).__name__, 'logits': logits[0, -1, :8].tolist(), 'gen': out[0, 6:].tolist()}\n"
        "print(json.dumps(got))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(run_dir / "hf")], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    opened = open_checkpoint(run_dir)  # the DCP checkpoint the folder was exported from
    model = load_eval_model(opened.model_args, opened.resolved, torch.device("cpu"))
    with torch.no_grad():
        expected = model(torch.tensor([[1, 2, 3, 4, 5, 6]]))[0, -1, :8]
    assert got["cls"] == "AtmaForCausalLM"
    torch.testing.assert_close(torch.tensor(got["logits"]), expected, atol=1e-5, rtol=1e-5)
    assert got["gen"] == greedy(model, [1, 2, 3, 4, 5, 6], 8)


def test_hf_tokenizer_goes_into_the_folder(tmp_path):
    pytest.importorskip("tokenizers")
    from bpe import train_bpe
    from transformers import AutoTokenizer

    from atma_titan.data.tokenizer import build_tokenizer

    path = train_bpe(tmp_path / "tokenizer.json", ["<pad>", "<|endoftext|>"])
    out = export_hf(perturbed_debug_model(), tmp_path / "hf", debug_cfg("--data.tokenizer", str(path)))
    ours, theirs = build_tokenizer(str(path)), AutoTokenizer.from_pretrained(out)
    text = "the quick brown fox jumps"
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == ours.eot_id
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == ours.eot_id
    assert "AutoTokenizer.from_pretrained(folder, trust_remote_code=True)" in (out / "README.md").read_text()


# ---------------------------------------------------------------------------------------------
# The tokenizer files: AutoTokenizer and lm-eval's hf model load the folder as it is, offline

TOKENIZER_TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "", " ", "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF", "    def f(x):\n        return x ** 2  # four-space indent\n",
    "digits 0 7 42 1234567890 3.14159 1,000,000", "naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 🚀🎉 👍🏽 👨‍👩‍👧 and a flag 🇫🇷", "it's they're we'll I'd you've CAN'T", "a" * 50, " " * 13 + "x",
    "-" * 40 + "=" * 7, "\u00a0non-breaking\u2003em space\u200bzero-width", "trailing whitespace   \n   ",
    "mixed123abc___ZZZ!!!???",
]  # fmt: skip


def random_texts(n: int = 300) -> list[str]:
    """Strings drawn from letters, spaces, newlines, digits, punctuation and multi-byte characters: odd merges."""
    import random

    rng, alphabet = random.Random(0), "ab c\n\t 1 2é日🚀'-.,s"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(40))) for _ in range(n)]


def _no_network(url):
    raise ConnectionError(f"no network in the tests: {url}")


@pytest.fixture(scope="module")
def gpt2_encoding():
    """tiktoken's GPT-2 encoding when its files are cached here; else a stand-in that build_tokenizer("gpt2") gets
    meanwhile: a BPE that tiktoken trains here with GPT-2's split regex, its end-of-text token at 50256."""
    pytest.importorskip("tiktoken")
    import tiktoken
    import tiktoken.load
    import tiktoken.registry
    from tiktoken import _educational
    from tiktoken_ext.openai_public import r50k_pat_str

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiktoken.load, "read_file", _no_network)  # tiktoken's cache or nothing, never a download
        try:
            encoding = tiktoken.get_encoding("gpt2")
        except Exception:  # not cached (or a damaged cache): the stand-in
            corpus = "\n".join(TOKENIZER_TEXTS[:10]) * 2
            ranks = _educational.bpe_train(corpus, 400, r50k_pat_str, visualise=None)
            specials = {"<|endoftext|>": 50256}
            encoding = tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=specials)
            patch.setitem(tiktoken.registry.ENCODINGS, "gpt2", encoding)
        yield encoding


@pytest.fixture(scope="module")
def gpt2_folder(gpt2_encoding, tmp_path_factory):
    """The debug model with GPT-2's padded vocabulary (50304), exported with data.tokenizer = "gpt2"."""
    model = perturbed_debug_model(vocab_size=50304)
    cfg = debug_cfg("--data.tokenizer", "gpt2", "--model.vocab_size", "50304")
    return model, export_hf(model, tmp_path_factory.mktemp("gpt2") / "hf", cfg)


def test_gpt2_tokenizer_goes_into_the_folder_and_encodes_as_tiktoken(gpt2_folder, gpt2_encoding):
    from transformers import AutoTokenizer

    _, folder = gpt2_folder
    theirs = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    for text in [*TOKENIZER_TEXTS, *random_texts()]:
        ids = theirs(text)["input_ids"]
        assert ids == gpt2_encoding.encode(text, disallowed_special=()), text
        assert theirs.decode(ids) == text
    assert theirs.eos_token == theirs.bos_token == "<|endoftext|>" and theirs.eos_token_id == 50256
    assert theirs.decode([*theirs("ab")["input_ids"], 50256], skip_special_tokens=True) == "ab"
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == 50304 and config["eos_token_id"] == 50256
    assert "The run's tokenizer ('gpt2') is in this folder" in (folder / "README.md").read_text()


def test_byte_tokenizer_goes_into_the_folder_as_bytes(hf_folder):
    """Ids 0-255 are the UTF-8 bytes, 256 <|endoftext|>; any ids decode as ByteTokenizer decodes them (U+FFFD for
    invalid UTF-8)."""
    import random

    from transformers import AutoTokenizer

    from atma_titan.data.tokenizer import ByteTokenizer

    theirs = AutoTokenizer.from_pretrained(hf_folder, trust_remote_code=True)
    for text in [*TOKENIZER_TEXTS, *random_texts()]:
        assert theirs(text)["input_ids"] == list(text.encode()), text
        assert theirs.decode(list(text.encode())) == text
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(256) for _ in range(rng.randrange(1, 12))]
        assert theirs.decode(ids) == ByteTokenizer().decode(ids) == bytes(ids).decode(errors="replace")
    assert (theirs.eos_token, theirs.eos_token_id, theirs.bos_token_id, len(theirs)) == ("<|endoftext|>", 256, 256, 257)
    assert theirs.decode([104, 256, 105], skip_special_tokens=True) == "hi"


def test_a_tokenizer_that_cannot_be_built_leaves_the_export_without_it_and_says_how_to_add_it(
    gpt2_folder, tmp_path, monkeypatch, capsys
):
    """gpt2 offline without tiktoken's files: the export command still writes the model, and one line says why the
    tokenizer is missing and the command that adds it."""
    import tiktoken.load
    import tiktoken.registry

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tiktoken.load, "read_file", _no_network)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "gpt2", raising=False)
    _, source = gpt2_folder
    out = tmp_path / "out"
    assert export_main(["--checkpoint", str(source), "--out", str(out), "--dtype", "bf16"]) == 0
    warning = capsys.readouterr().err.strip()
    assert warning.startswith(f"warning: no tokenizer files in {out}") and "\n" not in warning
    assert "GPT-2 BPE files could not be downloaded" in warning
    assert warning.endswith(
        f"`python -m atma_titan.export --checkpoint {source} --out {out} --dtype bf16` where tokenizer 'gpt2' builds"
    )
    assert not (out / "tokenizer.json").exists() and (out / "model.safetensors").is_file()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 50256  # known without it
    assert "This folder has no tokenizer files" in (out / "README.md").read_text()


@pytest.mark.slow
def test_the_folder_loads_offline_in_transformers_and_lm_eval(gpt2_folder, gpt2_encoding):
    """A fresh interpreter with HF_HUB_OFFLINE=1 and no tiktoken: AutoTokenizer, AutoModelForCausalLM and lm-eval's
    HFLM take the folder as it is; HFLM's log-likelihood of a continuation is the model's."""
    pytest.importorskip("lm_eval")
    model, folder = gpt2_folder
    script = (
        "import json, sys\n"
        "sys.modules['tiktoken'] = None  # the folder alone: no tiktoken\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from lm_eval.api.instance import Instance\n"
        "from lm_eval.models.huggingface import HFLM\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "hf = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "lm = HFLM(pretrained=sys.argv[1], trust_remote_code=True, device='cpu', batch_size=1)\n"
        "request = Instance('loglikelihood', doc={}, arguments=('The cat sat on', ' the mat'), idx=0)\n"
        "(logprob, _), = lm.loglikelihood([request])\n"
        "got = {'ids': tok('The cat sat on the mat')['input_ids'], 'model': type(hf).__name__, 'logprob': logprob}\n"
        "print(json.dumps(got))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=300, cwd="/", env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    context = gpt2_encoding.encode("The cat sat on")
    whole = gpt2_encoding.encode("The cat sat on the mat")
    assert got["ids"] == whole and got["model"] == "AtmaForCausalLM"
    with torch.no_grad():
        logprobs = model(torch.tensor([whole[:-1]])).float().log_softmax(-1)[0]
    expected = sum(logprobs[i - 1, whole[i]].item() for i in range(len(context), len(whole)))
    assert got["logprob"] == pytest.approx(expected, abs=1e-4)


def test_sharded_weights_load_everywhere(tmp_path):
    model = perturbed_debug_model()
    out = export_hf(model, tmp_path / "hf", debug_cfg(), max_shard_size="200KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    fresh = build_model(read_hf_model_args(out), torch.device("cpu"))
    load_hf_weights(fresh, out)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(AtmaForCausalLM.from_pretrained(out).model.head.weight, model.head.weight)


def test_export_replaces_a_previous_one_whole_with_world_readable_files(tmp_path):
    """A sharded export then a single-file one into the same folder: no stale shard, every file 0o644 under umask 022
    (safetensors makes its files 0o600), and nothing beside the folder."""
    model = perturbed_debug_model()
    out = export_hf(model, tmp_path / "hf", debug_cfg(), max_shard_size="200KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    old = os.umask(0o022)
    try:
        export_hf(model, out, debug_cfg())
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert "model.safetensors" in modes and not [n for n in modes if n.startswith("model-")]
    assert set(modes.values()) == {0o644}, modes
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


# ---------------------------------------------------------------------------------------------
# The export command, eval and generate


@pytest.mark.slow
def test_export_command_from_a_run_folder_in_bf16(run_dir, tmp_path):
    from safetensors import safe_open

    assert export_main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "out"), "--dtype", "bf16"]) == 0
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.head.weight").dtype == torch.bfloat16
    assert "weights in bfloat16" in (tmp_path / "out" / "README.md").read_text()


def test_export_of_a_checkpoint_without_its_config_exits_2(run_dir, tmp_path, capsys):
    lone = tmp_path / "lone" / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", lone)
    assert export_main(["--checkpoint", str(lone / "step-2"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no config.toml found" in err and "--config" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_eval_and_generate_take_the_folder(run_dir, tmp_path, capsys):
    from atma_titan.generate import main as generate_main

    opened = open_checkpoint(run_dir / "hf")
    assert opened.resolved.kind == "hf" and opened.resolved.step == 2
    from_hf = load_eval_model(opened.model_args, opened.resolved, torch.device("cpu"))
    dcp = open_checkpoint(run_dir)
    from_dcp = load_eval_model(dcp.model_args, dcp.resolved, torch.device("cpu"))
    for (name, a), b in zip(from_dcp.state_dict().items(), from_hf.state_dict().values()):
        assert torch.equal(a, b), name
    argv = ["--checkpoint", str(run_dir / "hf"), "--prompt", "ab", "--max-new-tokens", "4", "--temperature", "0"]
    assert generate_main(argv) == 0
    assert "4 tokens in" in capsys.readouterr().err
    from atma_titan.eval.__main__ import main as eval_main

    out = tmp_path / "eval"
    assert eval_main(["--checkpoint", str(run_dir / "hf"), "--gaps", "64", "--trials", "2", "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["step"] == 2


def test_a_folder_of_another_model_is_refused_with_the_fields(run_dir, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(run_dir / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "d_model": 64, "n_layers": 2}))
    with pytest.raises(InputError, match=r"d_model 64 \(expected 128\); n_layers 2 \(expected 4\)"):
        open_checkpoint(folder)
    model = build_model(read_hf_model_args(run_dir / "hf"), torch.device("cpu"))
    with pytest.raises(InputError, match="d_model 64"):
        load_hf_weights(model, folder)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The perturbed debug model exported once: tests damage a copy of it, or read it without transformers."""
    return export_hf(perturbed_debug_model(), tmp_path_factory.mktemp("hf_folder") / "hf", debug_cfg())


def test_a_folder_whose_tensor_has_another_shape_is_refused_naming_it_and_both_shapes(hf_folder, tmp_path, capsys):
    """config.json is the model's, but one tensor in model.safetensors is not: refused before anything is loaded."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from atma_titan.eval.__main__ import main as eval_main

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    weights = folder / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        metadata, state = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    state["model.head.weight"] = state["model.head.weight"][:, :64].contiguous()  # (512, 128) -> (512, 64)
    save_file(state, str(weights), metadata=metadata)

    model = build_model(read_hf_model_args(folder), torch.device("cpu"), seed=0)  # initialised: no NaN garbage
    before = model.head.weight.clone()
    with pytest.raises(InputError) as err:
        load_hf_weights(model, folder)
    problems = str(err.value).split("do not fit the model: ", 1)[1]
    assert problems == "shapes differ: head.weight (512, 64) (model (512, 128))"  # nothing missing or unexpected
    assert torch.equal(model.head.weight, before)

    out = tmp_path / "eval"
    assert eval_main(["--checkpoint", str(folder), "--gaps", "64", "--trials", "2", "--out", str(out)]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("error: ") and message.endswith(problems) and "\n" not in message


# ---------------------------------------------------------------------------------------------
# checkpoint.initial_load_hf


def test_initial_load_hf_with_other_model_args_exits_2(run_dir, tmp_path):
    proc = run_trainer(
        1, *TINY, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "1",
        "--checkpoint.initial_load_hf", str(run_dir / "hf"), "--model.mlp_hidden", "256",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "checkpoint.initial_load_hf" in proc.stderr and "mlp_hidden 512 (expected 256)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_initial_load_hf_and_load_path_together_are_refused():
    from atma_titan.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.initial_load_hf"):
        debug_cfg("--checkpoint.initial_load_hf", "a", "--checkpoint.load_path", "b")


@pytest.mark.slow
def test_initial_load_hf_trains_at_one_and_two_ranks(run_dir, tmp_path):
    """The first step's loss is the loaded model's (not ln V of the zero-initialised head), the same at 1 and
    2 FSDP ranks; the 2-rank run exports its own folder collectively, which loads back."""
    common = [*TINY, "--training.steps", "1", "--checkpoint.initial_load_hf", str(run_dir / "hf")]
    one = run_trainer(1, *common, "--job.dump_folder", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "loaded model weights from" in one.stdout
    two = run_trainer(2, *common, "--job.dump_folder", str(tmp_path / "two"), "--checkpoint.export_hf", "true")
    assert two.returncode == 0, two.stderr[-3000:]
    loss_one, loss_two = losses(tmp_path / "one")[1], losses(tmp_path / "two")[1]
    assert abs(loss_one - math.log(512)) > 0.01
    assert loss_two == pytest.approx(loss_one, abs=1e-4)
    exported_by_two = tmp_path / "two" / "hf"
    model = build_model(read_hf_model_args(exported_by_two), torch.device("cpu"))
    load_hf_weights(model, exported_by_two)


@pytest.mark.slow
def test_export_hf_added_to_a_finished_run_exports_without_training_again(tmp_path):
    common = [*TINY, "--job.dump_folder", str(tmp_path), "--training.steps", "1", "--checkpoint.enable", "true"]
    assert run_trainer(1, *common).returncode == 0
    rerun = run_trainer(1, *common, "--checkpoint.export_hf", "true")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "exported the Hugging Face folder" in rerun.stdout and (tmp_path / "hf" / "config.json").is_file()
    assert list(losses(tmp_path)) == [1]  # nothing was trained twice


# ---------------------------------------------------------------------------------------------
# Without the hf extra

_WITHOUT_TRANSFORMERS = """
import runpy, sys

sys.modules["transformers"] = None  # as if not installed: `import transformers` raises ImportError
from atma_titan.utils.errors import MissingExtraError

try:
    from atma_titan.hf.modeling import AtmaForCausalLM
except MissingExtraError as e:
    print(e)
sys.argv = ["atma_titan.export", *sys.argv[1:]]
runpy.run_module("atma_titan.export", run_name="__main__")
"""


def test_without_transformers_the_hf_model_and_export_name_the_hf_extra(hf_folder, tmp_path):
    """A fresh interpreter without transformers: AtmaForCausalLM is a one-line error naming the extra, and the export
    command (which reads the folder without transformers) exits 2 with that line, writing nothing."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRANSFORMERS, "--checkpoint", str(hf_folder), "--out", str(out)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    needs = "needs the transformers package: pip install 'atma_titan[hf]' (or pip install transformers)"
    assert proc.stdout.splitlines()[:1] == [f"the Hugging Face model (atma_titan.hf) {needs}"], proc.stderr[-3000:]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == f"error: the Hugging Face export {needs}"
    assert not out.exists() and not list(tmp_path.glob(".out*"))
