"""Tests for the streaming document sources: text/jsonl/parquet files (local, compressed, fsspec) and errors."""

from __future__ import annotations

import gzip
import itertools
import json
import uuid

import fsspec
import pytest

from atma_titan.data.documents import DataSourceError, DocumentSource, HFDataset, TextFiles


def write_jsonl(path, texts, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({field: text, "id": i}) + "\n")
    return path


def write_parquet(path, texts, row_group_size=3, field="text"):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: texts, "n": list(range(len(texts)))}), str(path), row_group_size=row_group_size)
    return path


def one_pass(source: DocumentSource, part: int = 0, num_parts: int = 1) -> list[tuple[str, dict]]:
    """This part's documents (with their states) of the first pass (epoch 0)."""
    return list(itertools.takewhile(lambda d: d[1]["epoch"] == 0, source.documents(part, num_parts)))


def texts(docs) -> list[str]:
    return [text for text, _ in docs]


@pytest.fixture
def corpus(tmp_path):
    """Five jsonl files of 4-7 documents each; returns (pattern, documents in file order)."""
    all_docs = []
    for f in range(5):
        docs = [f"file {f} doc {d} " + "x" * d for d in range(4 + f % 4)]
        write_jsonl(tmp_path / f"part_{f:02d}.jsonl", docs)
        all_docs += docs
    return str(tmp_path / "part_*.jsonl"), all_docs


@pytest.fixture
def memdir():
    root = f"memory://docs-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


# ---------------------------------------------------------------- formats


def test_txt_files_are_one_document_each(tmp_path):
    (tmp_path / "b.txt").write_text("second\nfile\n")
    (tmp_path / "a.txt").write_text("first file ✓")
    (tmp_path / "c.txt").write_bytes(b"bad \xff byte")
    source = TextFiles(str(tmp_path / "*.txt"))
    assert isinstance(source, DocumentSource)
    assert texts(one_pass(source)) == ["first file ✓", "second\nfile\n", "bad \ufffd byte"]  # sorted by name


def test_jsonl_with_blank_and_empty_documents(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": ""}\n{"text": null}\n  \n{"text": "two", "meta": 1}\n')
    docs = one_pass(TextFiles(str(path)))
    assert texts(docs) == ["one", "two"]
    # Empty and null documents are skipped but keep their place: "two" is document 3 of the file.
    assert docs[1][1] == {"epoch": 0, "unit": 0, "doc": 4}


def test_parquet_by_row_group_and_custom_field(tmp_path):
    write_parquet(tmp_path / "p.parquet", [f"row {i}" for i in range(10)], row_group_size=3, field="content")
    source = TextFiles(str(tmp_path / "p.parquet"), text_field="content")
    docs = one_pass(source)
    assert texts(docs) == [f"row {i}" for i in range(10)]
    for i in (0, 2, 3, 7, 9):  # resume inside and at the edges of row groups
        resumed = source.documents(0, 1, docs[i][1])
        assert [next(resumed)[0] for _ in range(3)] == [f"row {(i + k) % 10}" for k in range(1, 4)]


def test_gzip_jsonl_and_txt(tmp_path):
    write_jsonl(tmp_path / "a.jsonl.gz", ["zipped one", "zipped two"], opener=gzip.open)
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write("zipped text file")
    assert texts(one_pass(TextFiles(str(tmp_path / "*.gz")))) == ["zipped one", "zipped two", "zipped text file"]


def test_mixed_formats_from_a_directory(tmp_path):
    write_jsonl(tmp_path / "1.jsonl", ["j0", "j1"])
    write_parquet(tmp_path / "2.parquet", ["p0", "p1", "p2"])
    (tmp_path / "3.txt").write_text("t0")
    (tmp_path / "README.md").write_text("not data")  # a directory takes only the supported files
    source = TextFiles(str(tmp_path))
    assert len(source.files) == 3
    assert texts(one_pass(source)) == ["j0", "j1", "p0", "p1", "p2", "t0"]


def test_fsspec_memory_urls(memdir):
    fs = fsspec.filesystem("memory")
    for i in range(3):
        with fs.open(f"{memdir}/shard_{i}.jsonl", "w") as f:
            f.write("".join(json.dumps({"text": f"mem {i}.{j}"}) + "\n" for j in range(2)))
    with fsspec.open(f"{memdir}/zipped.jsonl.gz", "wt", compression="gzip") as f:
        f.write(json.dumps({"text": "mem zipped"}) + "\n")
    source = TextFiles(f"{memdir}/*.jsonl*")
    assert all(url.startswith("memory://") for url in source.files)
    assert texts(one_pass(source)) == ["mem 0.0", "mem 0.1", "mem 1.0", "mem 1.1", "mem 2.0", "mem 2.1", "mem zipped"]


# ---------------------------------------------------------------- split and resume


@pytest.mark.parametrize("num_parts", [1, 2, 3, 5, 6, 7, 13])
def test_parts_cover_every_document_exactly_once(corpus, num_parts):
    pattern, all_docs = corpus  # 5 files: whole files per part up to 5 parts, documents beyond
    source = TextFiles(pattern)
    seen = [text for part in range(num_parts) for text in texts(one_pass(source, part, num_parts))]
    assert sorted(seen) == sorted(all_docs) and len(seen) == len(all_docs)


def test_split_rules(corpus):
    pattern, all_docs = corpus
    source = TextFiles(pattern)
    # At least as many files as parts: part 1 of 2 reads files 1 and 3.
    assert texts(one_pass(source, 1, 2)) == [d for d in all_docs if d.startswith(("file 1 ", "file 3 "))]
    # Fewer files than parts: every file cut by document number mod 7 (7 = 7 / gcd(5, 7)); file f's cuts go to
    # parts 0..6 rotated by f * 7 // 5, so part 2 reads documents 2, 3, 4, 6, 0 mod 7 of files 0..4.
    per_file = [[d for d in all_docs if d.startswith(f"file {f} ")] for f in range(5)]
    assert texts(one_pass(source, 2, 7)) == [d for f, r in enumerate([2, 3, 4, 6, 0]) for d in per_file[f][r::7]]
    # 5 files and 10 parts: each file in halves (even and odd documents), one half per part.
    assert texts(one_pass(source, 3, 10)) == per_file[1][1::2]


@pytest.mark.parametrize("num_parts", [1, 2, 7])
def test_resume_from_every_yielded_state(corpus, num_parts):
    source = TextFiles(corpus[0])
    part = num_parts - 1
    stream = list(itertools.islice(source.documents(part, num_parts), 40))  # more than one pass
    assert any(state["epoch"] == 1 for _, state in stream)  # passes repeat in the same order
    for i in range(len(stream) - 3):
        resumed = source.documents(part, num_parts, stream[i][1])
        assert [next(resumed) for _ in range(3)] == stream[i + 1 : i + 4]


def test_state_of_another_part_is_refused(corpus):
    source = TextFiles(corpus[0])
    _, state = next(source.documents(0, 2))
    with pytest.raises(ValueError, match="another part"):
        next(source.documents(1, 2, state))


# ---------------------------------------------------------------- errors


def test_no_file_matches(tmp_path, memdir):
    with pytest.raises(DataSourceError, match=r"no file matches .*nothing_\*\.jsonl"):
        TextFiles(str(tmp_path / "nothing_*.jsonl"))
    with pytest.raises(DataSourceError, match=r"no file matches .*absent\.txt"):
        TextFiles(str(tmp_path / "absent.txt"))
    with pytest.raises(DataSourceError, match=r"no file matches 'memory://.*/x_\*\.txt'"):
        TextFiles(f"{memdir}/x_*.txt")


def test_unknown_extension(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n')
    (tmp_path / "b.csv").write_text("text\nno\n")
    with pytest.raises(DataSourceError, match=r"b\.csv: unknown extension; supported: \.txt, \.jsonl, \.parquet"):
        TextFiles(str(tmp_path / "*"))
    (tmp_path / "c.parquet.gz").write_bytes(b"")
    with pytest.raises(DataSourceError, match=r"c\.parquet\.gz: unknown extension"):
        TextFiles(str(tmp_path / "c.parquet.gz"))


def test_bad_json_line_names_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n\n{"text": oops}\n')
    with pytest.raises(DataSourceError, match=r"bad\.jsonl: line 3 is not valid JSON"):
        one_pass(TextFiles(str(tmp_path / "bad.jsonl")))
    (tmp_path / "list.jsonl").write_text('["text"]\n')
    with pytest.raises(DataSourceError, match=r"list\.jsonl: line 1 is a JSON list, not an object"):
        one_pass(TextFiles(str(tmp_path / "list.jsonl")))


def test_missing_or_wrong_text_field(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x", "y"], field="content")
    with pytest.raises(DataSourceError, match=r"a\.jsonl: line 1 has no field 'text'; its fields: 'content', 'id'"):
        one_pass(TextFiles(str(tmp_path / "a.jsonl")))
    (tmp_path / "n.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(DataSourceError, match=r"n\.jsonl: line 1: field 'text' holds a int, not a string"):
        one_pass(TextFiles(str(tmp_path / "n.jsonl")))
    write_parquet(tmp_path / "p.parquet", ["x"], field="body")
    with pytest.raises(DataSourceError, match=r"p\.parquet: no column 'text'; its columns: 'body', 'n'"):
        one_pass(TextFiles(str(tmp_path / "p.parquet")))
    with pytest.raises(DataSourceError, match=r"p\.parquet: column 'n' holds int64, not strings"):
        one_pass(TextFiles(str(tmp_path / "p.parquet"), text_field="n"))


def test_empty_dataset_and_empty_part(tmp_path):
    (tmp_path / "e0.jsonl").write_text("\n")
    write_jsonl(tmp_path / "e1.jsonl", ["", None])
    with pytest.raises(DataSourceError, match=r"empty dataset: the 2 files matching .*e\*\.jsonl.* hold no documents"):
        next(TextFiles(str(tmp_path / "e*.jsonl")).documents(0, 1))
    write_jsonl(tmp_path / "few.jsonl", ["a", "b"])
    source = TextFiles(str(tmp_path / "few.jsonl"))
    assert next(source.documents(1, 3))[0] == "b"
    with pytest.raises(DataSourceError, match=r"part 2 of 3 .* gets no documents.* only 2 documents"):
        next(source.documents(2, 3))


def test_zstd_without_zstandard_says_what_to_install(tmp_path):
    import fsspec.compression

    if "zstd" in fsspec.compression.compr:
        pytest.skip("zstandard is installed")
    (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    needs = r"a\.jsonl\.zst: reading zstd-compressed files needs: pip install zstandard"
    with pytest.raises(DataSourceError, match=needs):
        one_pass(TextFiles(str(tmp_path / "a.jsonl.zst")))


# ---------------------------------------------------------------- Hugging Face dataset errors


def test_hf_dataset_offline_says_how_to_work_offline(monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    # What HF_HUB_OFFLINE=1 does (read at import), without waiting on DNS retries.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataSourceError) as err:
        HFDataset("some-org/some-dataset-that-is-not-cached")
    message = str(err.value)
    assert "could not reach the dataset 'some-org/some-dataset-that-is-not-cached'" in message
    assert "hf download --repo-type dataset some-org/some-dataset-that-is-not-cached" in message
    assert ".bin shards" in message and "data.source = 'text'" in message


def test_hf_dataset_missing_field(tmp_path):
    pytest.importorskip("datasets")
    write_jsonl(tmp_path / "a.jsonl", ["x", "y"], field="content")
    with pytest.raises(DataSourceError, match=r"has no field 'text'; its fields: 'content', 'id'"):
        HFDataset(str(tmp_path))
    assert texts(one_pass(HFDataset(str(tmp_path), text_field="content"))) == ["x", "y"]
