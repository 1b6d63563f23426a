"""data.document_mask in the training loop: off, the model is called exactly as before (no boundaries); on,
every micro-batch and the validation loss carry the windows' document starts (each EOT begins a document)."""

import json

import pytest
from helpers import SMALL

from atma_titan.config import load_config
from atma_titan.data.boundaries import document_starts
from atma_titan.models.atma import ATMA
from atma_titan.train import train

BYTE_EOT = 256  # the debug config's byte tokenizer


def recorded_calls(monkeypatch) -> list[tuple]:
    """(inputs, doc_start, training) of every model forward from here on."""
    calls = []
    forward = ATMA.forward

    def spy(self, tokens, *args, **kwargs):
        calls.append((tokens.clone(), kwargs.get("doc_start"), self.training))
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(ATMA, "forward", spy)
    return calls


def run(folder, *extra, steps=2):
    cfg = load_config(["--config", "train_configs/debug_model.toml", *SMALL, "--training.steps", str(steps), *extra])
    cfg.job.dump_folder = str(folder)
    train(cfg)
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mask", [False, True])
def test_every_forward_gets_the_document_starts_only_with_the_mask(tmp_path, monkeypatch, mask):
    calls = recorded_calls(monkeypatch)
    run(tmp_path, "--data.document_mask", str(mask).lower(), "--eval.interval", "2", "--eval.val_batches", "1")
    assert any(training for *_, training in calls) and any(not training for *_, training in calls)
    for tokens, doc_start, training in calls:
        if not mask or tokens.shape[1] != 32:  # the needle probes are single documents: never masked
            assert doc_start is None
        else:
            assert doc_start.tolist() == document_starts(tokens, BYTE_EOT).tolist()
    if mask:  # the synthetic windows of 32 tokens hold document boundaries: the mask had something to do
        assert any(d is not None and d.bool().any() for _, d, _ in calls)


def test_the_mask_changes_the_loss_and_the_header_says_it(tmp_path, capsys):
    plain = run(tmp_path / "plain", steps=3)
    masked = run(tmp_path / "masked", "--data.document_mask", "true", steps=3)
    assert "documents kept apart (data.document_mask): each begins at an EOT (id 256)" in capsys.readouterr().out
    # the initial model's head and residual outputs are zero: only from the third step do the mixers count
    assert plain[:2] == masked[:2] and plain[2] != masked[2]
