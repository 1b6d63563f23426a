"""The eval command's needle when the command line does not name one: the records needle at 1x-16x the
training length for a model trained on the synthetic source (said in the first line), the text needle
otherwise or when asked for."""

import json
from pathlib import Path
from types import SimpleNamespace

from helpers import run_eval

from atma_titan.eval.__main__ import choose_needle, check_arguments, parse_args

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 32  # EVAL_TRAIN's training.seq_len






def test_a_synthetic_trained_model_gets_the_records_needle_up_to_16x_its_training_length(run_dir, tmp_path):
    proc = run_eval("--checkpoint", str(run_dir), "--trials", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first == (
        "needle: --records at gaps 32, 128, 512 (1x, 4x, 16x the training length 32): this model was trained on "
        "data.source = 'synthetic', not on text; add --text-needle for the text needle"
    )
    rows = json.loads((tmp_path / "results.json").read_text())["needle"]
    assert {r["variant"] for r in rows} == {"records"}
    assert [r["gap"] for r in rows] == [32, 128, 512] and max(r["gap"] for r in rows) <= 16 * SEQ_LEN


def test_the_text_needle_when_asked_for(run_dir, tmp_path):
    proc = run_eval(
        "--checkpoint", str(run_dir), "--text-needle", "--gaps", "64", "--trials", "2", "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    assert "needle: --records" not in proc.stdout and "needle access  gap    64" in proc.stdout
    assert [r["variant"] for r in json.loads((tmp_path / "results.json").read_text())["needle"]] == ["access"]


def choice(argv: list[str], source: str = "synthetic"):
    args = parse_args(["--checkpoint", "x", *argv])
    cfg = SimpleNamespace(data=SimpleNamespace(source=source), training=SimpleNamespace(seq_len=256))
    return choose_needle(args, check_arguments(args), cfg)


def test_what_each_command_line_chooses():
    request, said = choice([])
    assert (request.records, request.gaps) == (True, [256, 1024, 4096]) and said.startswith("needle: --records")
    request, said = choice(["--records"])  # asked for: nothing to explain
    assert (request.records, request.gaps, said) == (True, [256, 1024, 4096], None)
    request, said = choice(["--gaps", "512"])
    assert (request.records, request.gaps) == (True, [512]) and "gaps 512 (2x the training length 256)" in said
    for text in (["--text-needle"], ["--passkey"], ["--haystack", "data"]):  # options of the text needle alone
        request, said = choice(text)
        assert (request.records, request.gaps[-1], said) == (False, 65536, None)
    request, said = choice([], source="text")
    assert (request.records, request.gaps, said) == (False, [2048, 4096, 8192, 16384, 32768, 65536], None)
    request, _ = choice(["--max-length", "2048"])  # the default gaps stop at --max-length
    assert request.gaps == [256, 1024]
    assert choice(["--no-needle", "--length-curve"])[0].gaps == []


def test_records_and_text_needle_together_are_bad_input(capsys):
    from atma_titan.eval.__main__ import main

    assert main(["--checkpoint", "x", "--records", "--text-needle"]) == 2
    assert "--records and --text-needle" in capsys.readouterr().err
