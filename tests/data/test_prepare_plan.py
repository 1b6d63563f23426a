"""The prepare command records its plan in the output folder and refuses to mix another plan into it."""

import json

import pytest

from atma_titan.data.prepare import PLAN, PlanMismatch, prepare
from atma_titan.prepare import main
from test_prepare import corpus, job


def test_first_run_records_its_plan(tmp_path):
    pattern, _ = corpus(tmp_path)
    prepare(job(pattern, tmp_path / "out"), progress=False)
    plan = json.loads((tmp_path / "out" / PLAN).read_text())
    assert plan["parts"] == 4 and plan["inputs"]["files"] == 3 and plan["tokenizer"]["name"] == "byte"
    assert {"split", "source", "text_field", "shard_tokens", "val_tokens"} <= set(plan)


def test_another_part_count_is_refused_before_anything_is_written(tmp_path):
    """The reported case: an interrupted run, re-run with another --parts, counted documents twice."""
    pattern, texts = corpus(tmp_path, files=1, docs=17)
    out = tmp_path / "out"
    prepare(job(pattern, out, parts=2), progress=False)
    (out / "parts" / "part-0001.json").unlink()  # as if part 1 had not finished
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(PlanMismatch, match=r"--parts: 3 now, 2 in the folder.*remove .*out or choose another --out"):
        prepare(job(pattern, out, parts=3), progress=False)
    assert sorted(p.name for p in out.rglob("*")) == before
    manifest = prepare(job(pattern, out, parts=2), progress=False)  # the folder's own plan resumes it
    assert manifest["documents"] == len(texts) == 17


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(shard_tokens=400), r"--shard-tokens: 400 now, 500 in the folder"),
        (dict(val_tokens=50), r"--val-tokens: 50 now, 0 in the folder"),
        (dict(text_field="body"), r"--text-field: 'body' now, 'text' in the folder"),
    ],
)
def test_every_setting_that_decides_the_output_is_checked(tmp_path, change, message):
    pattern, _ = corpus(tmp_path)
    prepare(job(pattern, tmp_path / "out"), progress=False)
    with pytest.raises(PlanMismatch, match=message):
        prepare(job(pattern, tmp_path / "out", **change), progress=False)


def test_another_tokenizer_is_refused(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<|endoftext|>": 0, "x": 1}, unk_token="x"))
    words.save(str(tmp_path / "words.json"))
    pattern, _ = corpus(tmp_path)
    prepare(job(pattern, tmp_path / "out"), progress=False)
    expected = r"--tokenizer: '.*words\.json' \(vocab 2, EOT 0\) now, 'byte' \(vocab 257, EOT 256\) in the folder"
    with pytest.raises(PlanMismatch, match=expected):
        prepare(job(pattern, tmp_path / "out", tokenizer=str(tmp_path / "words.json")), progress=False)


def test_the_input_files_are_the_input_not_the_patterns_spelling(tmp_path):
    pattern, _ = corpus(tmp_path)
    out = tmp_path / "out"
    first = prepare(job(pattern, out), progress=False)
    again = prepare(job(str(tmp_path), out), progress=False)  # the same three files, named by their folder
    assert again["train_shards"] == first["train_shards"] and again["documents"] == first["documents"]
    (tmp_path / "part9.jsonl").write_text(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(PlanMismatch, match=r"the input files \(--path\): 4 files now, 3 when the folder was started"):
        prepare(job(pattern, out), progress=False)


def test_output_of_an_older_prepare_without_a_plan_is_refused(tmp_path):
    pattern, _ = corpus(tmp_path)
    out = tmp_path / "out"
    prepare(job(pattern, out), progress=False)
    (out / PLAN).unlink()
    with pytest.raises(PlanMismatch, match=r"without a plan\.json .* remove .* or choose another --out"):
        prepare(job(pattern, out), progress=False)


def test_command_exits_2_naming_the_difference(tmp_path, capsys):
    pattern, _ = corpus(tmp_path)
    args = ["--path", pattern, "--tokenizer", "byte", "--out", str(tmp_path / "out"), "--no-progress"]
    assert main([*args, "--parts", "2"]) == 0
    capsys.readouterr()
    assert main([*args, "--parts", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--parts: 5 now, 2 in the folder" in err and "Traceback" not in err
