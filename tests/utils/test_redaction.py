"""Credentials in data URLs never leave the process: config.toml, the printed config, the metric sinks
(TensorBoard, wandb) and error messages show them as ***; the run folder is still recognised as the
same run on a restart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import SMALL
from http_shards import Server, make_shards

from atma_titan.config import JobConfig, load_config
from atma_titan.data.shards import BinShards, ShardError
from atma_titan.utils.errors import InputError
from atma_titan.metrics import MetricsLogger
from atma_titan.utils.redact import redact_config, redact_text, redact_url
from atma_titan.train import train

SECRETS = ("PW-SECRET", "TOKEN-SECRET", "SIG-SECRET")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("s3://AKIAKEY:PW-SECRET@bucket/x/train_*.bin", "s3://***@bucket/x/train_*.bin"),
        ("s3://AKIAKEY:PW/SECRET+x@bucket/x.bin", "s3://***@bucket/x.bin"),  # an AWS secret with a "/"
        ("https://user:PW-SECRET@host:8443/x.bin", "https://***@host:8443/x.bin"),
        (
            "https://b.s3.amazonaws.com/x.bin?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA%2F1&X-Amz-Signature=SIG-SECRET",
            "https://b.s3.amazonaws.com/x.bin?X-Amz-Algorithm=AWS4&X-Amz-Credential=***&X-Amz-Signature=***",
        ),
        ("https://h/x?sv=2022&sig=SIG-SECRET&se=2030", "https://h/x?sv=2022&sig=***&se=2030"),  # Azure SAS
        (
            "https://h/x?token=T&key=K&password=P&api_key=A&page=2",
            "https://h/x?token=***&key=***&password=***&api_key=***&page=2",
        ),
        ("https://h/a@b.bin", "https://h/a@b.bin"),  # an "@" in the path is no userinfo
        ("https://host:8080/x/a@b.bin", "https://host:8080/x/a@b.bin"),
        ("data/fineweb/train_*.bin", "data/fineweb/train_*.bin"),
        ("gs://bucket/x/train_[0-9].bin", "gs://bucket/x/train_[0-9].bin"),
    ],
)
def test_redact_url(url, shown):
    assert redact_url(url) == shown and redact_text(url) == shown
    assert redact_url(shown) == shown  # idempotent


def test_redact_text_finds_urls_in_messages_and_configs():
    text = "cannot read 'https://u:PW-SECRET@h/x.bin?token=TOKEN-SECRET': gone (see https://h/help)."
    assert redact_text(text) == "cannot read 'https://***@h/x.bin?token=***': gone (see https://h/help)."
    config = {"data": {"path": "s3://K:PW-SECRET@b/x", "seed": 3, "paths": ["https://h/?sig=SIG-SECRET"]}}
    assert redact_config(config) == {"data": {"path": "s3://***@b/x", "seed": 3, "paths": ["https://h/?sig=***"]}}


def test_input_errors_are_redacted():
    error = ShardError("no shard matches 's3://KEY:PW-SECRET@bucket/x/*.bin?token=TOKEN-SECRET'")
    assert not any(s in str(error) for s in SECRETS) and "s3://***@bucket/x/*.bin?token=***" in str(error)
    assert isinstance(error, InputError)


def test_config_toml_and_dict_are_redacted():
    url = "https://user:PW-SECRET@host/x/train_000.bin?token=TOKEN-SECRET"
    cfg = load_config(["--data.source", "bin", "--data.path", url])
    assert cfg.data.path == url  # the job reads the real URL
    for shown in (cfg.to_toml(), str(cfg.to_dict())):
        assert not any(s in shown for s in SECRETS) and "https://***@host/x/train_000.bin?token=***" in shown
    assert JobConfig().to_dict()["data"] == load_config([]).to_dict()["data"]  # nothing else changes


def test_metrics_logger_redacts_the_config_it_is_given(tmp_path):
    pytest.importorskip("tensorboard")
    config = {"data": {"path": "s3://KEY:PW-SECRET@b/x.bin?X-Amz-Signature=SIG-SECRET"}}
    with MetricsLogger(dump_folder=tmp_path, stdout=False, jsonl=False, tensorboard=True, config=config) as logger:
        logger.log(1, {"loss": 1.0})
    events = b"".join(p.read_bytes() for p in (tmp_path / "tb").rglob("*"))
    assert b"s3://***@b/x.bin?X-Amz-Signature=***" in events
    assert not any(s.encode() in events for s in SECRETS)


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "www" / "x"
    folder.mkdir(parents=True)
    make_shards(folder, [6000])
    srv = Server(tmp_path / "www")
    yield srv
    srv.stop()


def secret_url(server) -> str:
    host = server.url.removeprefix("http://")
    return f"http://user:PW-SECRET@{host}/x/train_000.bin?token=TOKEN-SECRET&X-Amz-Signature=SIG-SECRET"


@pytest.mark.slow
def test_training_writes_and_prints_no_credential(tmp_path, served, capsys):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    flags = [*SMALL, "--data.source", "bin", "--data.path", secret_url(served), "--job.dump_folder", str(run)]
    flags += ["--job.print_config", "true", "--metrics.tensorboard", "true"]
    last = train(load_config(flags))
    assert last["step"] == 3 and np.isfinite(last["loss"])
    out = capsys.readouterr().out
    saved = (run / "config.toml").read_text()
    events = b"".join(p.read_bytes() for p in (run / "tb").rglob("*")).decode("latin-1")
    for shown in (out, saved, events):
        assert "http://***@127.0.0.1" in shown and "token=***&X-Amz-Signature=***" in shown
        assert not any(s in shown for s in SECRETS)
    # The same job again: config.toml (redacted) equals the job's (redacted): the same, finished run.
    assert train(load_config(flags)) == {}
    assert "already complete" in capsys.readouterr().out


def test_shard_errors_name_the_url_without_its_credentials(served):
    url = secret_url(served).replace("train_000", "absent")
    with pytest.raises(InputError) as error:
        BinShards(url)
    assert "http://***@127.0.0.1" in str(error.value) and not any(s in str(error.value) for s in SECRETS)


@pytest.mark.slow
def test_train_command_keeps_credentials_out_of_every_sink(tmp_path, served):
    """The real command with wandb offline: stdout, stderr, config.toml and the whole wandb run folder
    (which also records the command line) hold no secret."""
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
        "WANDB_SILENT": "true",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "atma_titan.train", *SMALL, "--data.source", "bin", "--data.path", secret_url(served)]
        + ["--job.dump_folder", str(run), "--job.print_config", "true"]
        + ["--metrics.wandb", "true", "--metrics.wandb_mode", "offline"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    assert "token=***" in proc.stdout and not any(s in proc.stdout + proc.stderr for s in SECRETS)
    wandb_files = [p for p in (run / "wandb").rglob("*") if p.is_file()]
    assert wandb_files
    for path in [run / "config.toml", *wandb_files]:
        assert not any(s.encode() in path.read_bytes() for s in SECRETS), path
