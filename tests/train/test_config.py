import dataclasses
import subprocess
import sys

import pytest

from atma_titan.config import ConfigError, JobConfig, help_text, load_config
from atma_titan.models.flavors import FLAVORS, resolve_model_args
from distributed_utils import ROOT


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_toml_then_cli(tmp_path):
    path = write(tmp_path, '[training]\nsteps = 7\nseq_len = 64\nbatch_tokens = 512\n[model]\nattention = "softmax"\n')
    cfg = load_config(["--config", path, "--training.steps", "9", "--model.window=32"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.model.attention == "softmax" and cfg.model.window == 32
    assert cfg.optimizer.muon_lr == JobConfig().optimizer.muon_lr  # untouched default


def test_cli_types_are_parsed(tmp_path):
    cfg = load_config(
        [
            "--job.dry_run",
            "true",
            "--optimizer.adam_betas",
            "0.9,0.99",
            "--model.gamma_max",
            "0.99",
            "--metrics.wandb_entity",
            "none",
        ]
    )
    assert cfg.job.dry_run is True and cfg.optimizer.adam_betas == [0.9, 0.99]
    assert cfg.model.gamma_max == 0.99 and cfg.metrics.wandb_entity is None


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.stpes", "3"], ["training.stpes", "Did you mean 'steps'"]),
        (["--trainig.steps", "3"], ["unknown section [trainig]", "Did you mean 'training'"]),
        (["--training.steps", "many"], ["training.steps", "'many'", "expected an integer"]),
        (["--model.attention", "linear"], ["model.attention", "'linear'", "polar, softmax"]),
        (["--training.steps", "0"], ["training.steps", "0", ">= 1"]),
        (["--model.flavor", "huge"], ["model.flavor", "huge", "debug, atma_370m"]),
        (["--model.global_layers", "every other"], ["global_layers", "i%4==2"]),
        (["--model.n_kv_heads", "3"], ["model.n_kv_heads", "divisor"]),
        (["--model.polar_direction", "half"], ["model.polar_direction", "'half'", "rms, unit"]),
        (["--debug.memory_cap_gib", "-1"], ["debug.memory_cap_gib", "-1", ">= 0"]),
    ],
)
def test_bad_values_name_key_value_and_allowed(argv, expected):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    for text in expected:
        assert text in str(err.value)


def test_toml_errors_name_the_file(tmp_path):
    path = write(tmp_path, '[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match=r"job\.toml.*training\.steps.*'ten'.*integer"):
        load_config(["--config", path])
    path = write(tmp_path, "[metrics]\nlog_frequency = 5\n")
    with pytest.raises(ConfigError, match=r"job\.toml.*metrics\.log_frequency.*Did you mean 'log_freq'"):
        load_config(["--config", path])
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config", str(tmp_path / "missing.toml")])


def test_help_lists_every_option_with_default():
    text = help_text()
    cfg = JobConfig().to_dict()
    for section, table in cfg.items():
        for key in table:
            assert f"--{section}.{key} " in text
    assert "default 'debug'" in text
    assert "--model.flavor (str {debug|atma_370m}, default 'debug')" in text  # the flavors are listed


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(["--model.window", "16", "--job.description", 'say "hi"'])
    path = write(tmp_path, cfg.to_toml())
    assert load_config(["--config", path]).to_dict() == cfg.to_dict()


def test_bad_config_exits_nonzero_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "atma_titan.train", "--training.stpes", "3"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Did you mean 'steps'" in proc.stderr and "Traceback" not in proc.stderr


def test_help_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "atma_titan.train", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--model.attention" in proc.stdout


def test_docs_config_reference_is_current():
    from pathlib import Path

    from atma_titan.config import REFERENCE_MARKERS, reference_markdown

    doc = Path(__file__).resolve().parents[2].joinpath("docs", "config.md").read_text()
    start, end = REFERENCE_MARKERS
    section = doc[doc.index(start) + len(start) : doc.index(end)]
    assert section == reference_markdown(), "regenerate with: python -m atma_titan.config --update docs/config.md"


@pytest.mark.parametrize(
    "command, default",
    [
        (["atma_titan.eval"], "(default: 2K,4K,8K,16K,32K,64K)"),
        (["atma_titan.sweep", "run"], "(default: None)"),
        (["atma_titan.sweep", "slurm"], "(default: 0)"),
    ],
)
def test_every_command_help_shows_its_defaults(command, default):
    proc = subprocess.run([sys.executable, "-m", *command, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert default in " ".join(proc.stdout.split())


def test_the_l4_recipe_differs_from_the_recipe_only_in_its_micro_batch():
    def resolved(name: str) -> dict:
        return dataclasses.asdict(load_config(["--config", str(ROOT / "train_configs" / name)]))

    recipe, l4 = resolved("atma_370m.toml"), resolved("atma_370m_l4.toml")
    assert l4["training"].pop("micro_batch_size") == 8 and recipe["training"].pop("micro_batch_size") == 16
    for run in (recipe, l4):
        del run["job"]["dump_folder"], run["job"]["description"]
    assert l4 == recipe


def test_the_370m_repro_cells_differ_only_in_attention_and_train_100m_synthetic_tokens():
    def resolved(name: str) -> dict:
        return dataclasses.asdict(load_config(["--config", str(ROOT / "train_configs" / "repro" / name)]))

    polar, softmax = resolved("atma_370m_polar_memory.toml"), resolved("atma_370m_softmax_memory.toml")
    assert (polar["model"]["flavor"], polar["training"]["seq_len"]) == ("atma_370m", 2048)
    # the toy cells' synthetic language (it draws its tokens from the whole vocabulary) in the 370M blocks
    toy = load_config(["--config", str(ROOT / "train_configs" / "repro" / "polar_memory.toml")])
    big = load_config(["--config", str(ROOT / "train_configs" / "repro" / "atma_370m_polar_memory.toml")])
    assert resolve_model_args(big.model).vocab_size == resolve_model_args(toy.model).vocab_size == 512
    assert resolve_model_args(big.model).d_model == FLAVORS["atma_370m"].d_model
    assert polar["data"]["source"] == "synthetic" and polar["data"]["recall_weight"] > 1  # weighted as the toy cells
    assert 95e6 < polar["training"]["steps"] * polar["training"]["batch_tokens"] < 105e6
    assert (polar["model"].pop("attention"), softmax["model"].pop("attention")) == ("polar", "softmax")
    for run in (polar, softmax):
        del run["job"]["dump_folder"], run["job"]["description"]
    assert polar == softmax
