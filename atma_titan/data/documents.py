"""Document sources for the streaming path: text files or a Hugging Face dataset, split and resumable.

Contract (``DocumentSource``): ``documents(part, num_parts, state=None)`` yields
``(text, state)`` pairs, forever: after the last document of a pass over this part's data
it starts the next pass (epoch) in the same order. ``state`` is a small JSON-like dict that
describes the position right after that document; passing it back as ``state`` resumes
with the next document. A state is only meaningful for the same source, ``part`` and
``num_parts``. ``num_parts`` is data-parallel ranks x loader workers per rank, and the
parts of one pass are disjoint and together cover every document exactly once.

Documents whose text is empty or null are skipped (they carry nothing to learn), but
they keep their place in the file, so positions and the split do not depend on them. A
part that gets no document at all in a full pass raises ``DataSourceError`` instead of
looping forever.

``TextFiles(pattern, text_field)``: the files matching a local path, glob or directory, or
any fsspec URL or URL glob (``s3://bucket/data/*.jsonl.gz``, ``memory://...``), sorted
by name. By extension:

* ``.txt``: the whole file is one document (UTF-8; invalid bytes become U+FFFD);
* ``.jsonl``: one JSON object per line, the document is its ``text_field``; blank lines
  are ignored;
* ``.parquet``: column ``text_field``, read one row group at a time with pyarrow;
* ``.txt`` and ``.jsonl`` may be compressed: ``.gz``, ``.bz2``, ``.xz``, ``.zst`` (the
  last needs the ``zstandard`` package).

Split: with at least ``num_parts`` files, part ``p`` reads files ``p, p + P, p + 2P, ...``
(whole files, no reading of other parts' files). With fewer files every part reads all
files and keeps documents ``p, p + P, ...`` of their concatenation. State:
``{"epoch", "file", "doc", "seen"}``: the next document is number ``doc`` (counting from
0, empty ones included) of file number ``file``; ``seen`` counts the documents of the
pass before it (used by the fewer-files split).

``HFDataset(name, config, split, text_field)``: ``datasets.load_dataset(..., streaming=True)``
of a hub id or a local directory/loader name (``"json"`` with ``data_files``), split with
``datasets.distributed.split_dataset_by_node`` (whole shards when the shard count divides
by ``num_parts``, else every ``num_parts``-th example), resumed with the
``IterableDataset``'s own ``state_dict()``. State: ``{"epoch", "hf"}``.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Protocol, runtime_checkable

from atma_titan.errors import InputError, import_optional

__all__ = ["DataSourceError", "DocumentSource", "TextFiles", "HFDataset"]


class DataSourceError(InputError):
    """A document source cannot be read: no files, a bad file, a missing field, an unreachable dataset."""


class EmptyPartError(DataSourceError):
    """A part (of ranks x loader workers, or of a prepare run) in which a full pass finds no document."""


@runtime_checkable
class DocumentSource(Protocol):
    def documents(self, part: int, num_parts: int, state: dict | None = None) -> Iterator[tuple[str, dict]]:
        """Yield (text, state after this document) for this part, pass after pass; resume after ``state``."""
        ...


def _check_part(part: int, num_parts: int) -> None:
    if num_parts < 1 or not 0 <= part < num_parts:
        raise ValueError(f"part must be in [0, num_parts), got part {part} of {num_parts}")


def _is_document(text) -> bool:
    return text is not None and text != ""


# ---------------------------------------------------------------------------- text files

_FORMATS = (".txt", ".jsonl", ".parquet")
# Suffix -> fsspec compression name; parquet compresses inside the format, so only txt/jsonl take these.
_COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}


def _file_kind(url: str) -> tuple[str, str | None]:
    """(format, compression) of a file from its name, e.g. ('.jsonl', 'gzip') for ``a.jsonl.gz``."""
    stem, suffix = os.path.splitext(url)
    compression = _COMPRESSIONS.get(suffix.lower())
    if compression is not None:
        stem, suffix = os.path.splitext(stem)
    fmt = suffix.lower()
    if fmt not in _FORMATS or (compression is not None and fmt == ".parquet"):
        raise DataSourceError(
            f"{url}: unknown extension; supported: .txt, .jsonl, .parquet, and .txt/.jsonl compressed "
            "as .gz, .bz2, .xz or .zst"
        )
    return fmt, compression


def _is_supported(url: str) -> bool:
    try:
        _file_kind(url)
    except DataSourceError:
        return False
    return True


def _match_files(pattern: str) -> list[str]:
    """Sorted files (local paths or URLs) that ``pattern`` names: a file, a glob or a directory."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, path = fsspec.core.url_to_fs(pattern)
    if glob.has_magic(path):
        found = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):  # a directory: the files in it (and below) with a supported extension
        found = [p for p in fs.find(path) if _is_supported(p)]
    elif fs.isfile(path):
        found = [path]
    else:
        found = []
    if not found:
        raise DataSourceError(f"no file matches {pattern!r}")
    if isinstance(fs, LocalFileSystem):
        return sorted(found)
    return sorted(fs.unstrip_protocol(p) for p in found)


def _open_binary(url: str, compression: str | None):
    import fsspec
    import fsspec.compression

    if compression is not None and compression not in fsspec.compression.compr:
        package = "zstandard" if compression == "zstd" else compression
        raise DataSourceError(
            f"{url}: reading {compression}-compressed files needs: pip install {package} "
            "(or pip install 'atma_titan[data]')"
        )
    return fsspec.open(url, "rb", compression=compression)


def _read_txt(url: str, compression: str | None, text_field: str, skip: int) -> Iterator[str | None]:
    if skip > 0:  # the file's only document was already read
        return
    with _open_binary(url, compression) as f:
        yield f.read().decode("utf-8", errors="replace")


def _jsonl_text(url: str, line_number: int, line: bytes, text_field: str) -> str | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataSourceError(f"{url}: line {line_number} is not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise DataSourceError(f"{url}: line {line_number} is a JSON {type(record).__name__}, not an object")
    if text_field not in record:
        fields = ", ".join(repr(k) for k in record) or "none"
        raise DataSourceError(f"{url}: line {line_number} has no field {text_field!r}; its fields: {fields}")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise DataSourceError(
            f"{url}: line {line_number}: field {text_field!r} holds a {type(text).__name__}, not a string"
        )
    return text


def _read_jsonl(url: str, compression: str | None, text_field: str, skip: int) -> Iterator[str | None]:
    index = 0  # documents = non-blank lines; blank lines are not documents
    with _open_binary(url, compression) as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if index >= skip:  # lines before the resume point are not even parsed
                yield _jsonl_text(url, line_number, line, text_field)
            index += 1


def _read_parquet(url: str, compression: str | None, text_field: str, skip: int) -> Iterator[str | None]:
    import fsspec

    pa = import_optional("pyarrow", "data", f"reading {url}")
    pq = import_optional("pyarrow.parquet", "data", f"reading {url}", "pyarrow")

    with fsspec.open(url, "rb") as f:
        parquet = pq.ParquetFile(f)
        names = parquet.schema_arrow.names
        if text_field not in names:
            raise DataSourceError(f"{url}: no column {text_field!r}; its columns: {', '.join(map(repr, names))}")
        column_type = parquet.schema_arrow.field(text_field).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise DataSourceError(f"{url}: column {text_field!r} holds {column_type}, not strings")
        first_row = 0
        for group in range(parquet.num_row_groups):
            rows = parquet.metadata.row_group(group).num_rows
            if first_row + rows > skip:  # row groups wholly before the resume point are not read
                texts = parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist()
                yield from texts[max(skip - first_row, 0) :]
            first_row += rows


_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


class TextFiles:
    """Documents from text, JSON-lines or parquet files (see the module docstring for the contract)."""

    def __init__(self, pattern: str, text_field: str = "text"):
        self.pattern, self.text_field = pattern, text_field
        self.files = _match_files(pattern)
        self._kinds = [_file_kind(url) for url in self.files]  # an unknown extension fails here, early

    def __repr__(self) -> str:
        return f"TextFiles({self.pattern!r}, text_field={self.text_field!r}; {len(self.files)} files)"

    def read_file(self, index: int, skip: int = 0) -> Iterator[str | None]:
        """The raw documents of file ``index`` from document ``skip`` on (None or '' for empty ones)."""
        fmt, compression = self._kinds[index]
        return _READERS[fmt](self.files[index], compression, self.text_field, skip)

    def count_documents(self) -> int:
        """Non-empty documents in all files (reads everything; used to explain an empty part)."""
        return sum(sum(map(_is_document, self.read_file(i))) for i in range(len(self.files)))

    def documents(self, part: int, num_parts: int, state: dict | None = None) -> Iterator[tuple[str, dict]]:
        _check_part(part, num_parts)
        by_file = len(self.files) >= num_parts
        one_pass = self._pass_by_file if by_file else self._pass_by_document
        first_file = part if by_file else 0
        state = dict(state) if state else self._pass_start(0, first_file)
        if by_file and (state["file"] - part) % num_parts:
            raise ValueError(f"state {state} belongs to another part than part {part} of {num_parts}")
        while True:
            full_pass = state == self._pass_start(state["epoch"], first_file)
            found = False
            for text, after in one_pass(part, num_parts, state):
                found = True
                yield text, after
            if full_pass and not found:
                raise self._empty_part_error(part, num_parts)
            state = self._pass_start(state["epoch"] + 1, first_file)

    @staticmethod
    def _pass_start(epoch: int, first_file: int) -> dict:
        return {"epoch": epoch, "file": first_file, "doc": 0, "seen": 0}

    def _pass_by_file(self, part: int, num_parts: int, start: dict) -> Iterator[tuple[str, dict]]:
        """Files part, part + P, ...: every document of each, from the start position on."""
        epoch = start["epoch"]
        for index in range(start["file"], len(self.files), num_parts):
            skip = start["doc"] if index == start["file"] else 0
            for doc, text in enumerate(self.read_file(index, skip), start=skip):
                if _is_document(text):
                    yield text, {"epoch": epoch, "file": index, "doc": doc + 1, "seen": 0}

    def _pass_by_document(self, part: int, num_parts: int, start: dict) -> Iterator[tuple[str, dict]]:
        """All files; documents part, part + P, ... of their concatenation, from the start position on."""
        epoch, seen = start["epoch"], start["seen"]
        for index in range(start["file"], len(self.files)):
            skip = start["doc"] if index == start["file"] else 0
            for doc, text in enumerate(self.read_file(index, skip), start=skip):
                mine = seen % num_parts == part
                seen += 1
                if mine and _is_document(text):
                    yield text, {"epoch": epoch, "file": index, "doc": doc + 1, "seen": seen}

    def _empty_part_error(self, part: int, num_parts: int) -> DataSourceError:
        total = self.count_documents()
        if total == 0:
            return DataSourceError(
                f"empty dataset: the {len(self.files)} files matching {self.pattern!r} hold no documents "
                f"(no non-empty text{'' if self._only_txt() else f' in field {self.text_field!r}'})"
            )
        return EmptyPartError(
            f"part {part} of {num_parts} (ranks x loader workers) gets no documents from {self.pattern!r}: "
            f"{len(self.files)} files hold only {total} documents; use fewer ranks or loader workers, or more data"
        )

    def _only_txt(self) -> bool:
        return all(fmt == ".txt" for fmt, _ in self._kinds)


# ---------------------------------------------------------------------------- Hugging Face datasets


def _offline_help(name: str) -> str:
    return (
        "To work offline: download it on a machine with internet "
        f"(`hf download --repo-type dataset {name} --local-dir DIR`) and pass the local "
        "directory as the dataset name; or tokenize it there with the prepare command and train on its "
        ".bin shards; or point data.source = 'text' at local parquet/jsonl files"
    )


def _import_datasets():
    datasets = import_optional("datasets", "data", "data.source = 'hf'")
    if not hasattr(datasets.IterableDataset, "load_state_dict"):
        raise DataSourceError(
            f"HFDataset resumes with IterableDataset.state_dict(), which needs datasets >= 2.18 "
            f"(installed: {datasets.__version__}): pip install -U datasets"
        )
    return datasets


class HFDataset:
    """Documents from a Hugging Face dataset, streamed (see the module docstring for the contract).

    ``name`` is a hub id (``"HuggingFaceFW/fineweb-edu"``), a local directory of
    jsonl/parquet/... files, or a builder name such as ``"json"`` / ``"parquet"`` with
    ``data_files``. The dataset is opened at construction, so a wrong name, an unreachable
    hub or a missing ``text_field`` fails before training starts.
    """

    def __init__(
        self,
        name: str,
        config: str | None = None,
        split: str = "train",
        text_field: str = "text",
        data_files=None,
    ):
        self.name, self.config, self.split, self.text_field = name, config, split, text_field
        self.data_files = data_files
        self._dataset = self._load()
        self._check_field(self._dataset.column_names)

    def __repr__(self) -> str:
        return f"HFDataset({self.name!r}, config={self.config!r}, split={self.split!r}, text_field={self.text_field!r})"

    def _load(self):
        datasets = _import_datasets()
        try:
            return datasets.load_dataset(
                self.name, self.config, split=self.split, data_files=self.data_files, streaming=True
            )
        except (ImportError, DataSourceError):
            raise
        except Exception as exc:  # ConnectionError (offline, HF_HUB_OFFLINE=1), not found, bad config/split
            if os.path.exists(self.name) or self.data_files is not None:
                raise DataSourceError(f"could not load the local dataset {self.name!r}: {exc}") from exc
            raise DataSourceError(
                f"could not reach the dataset {self.name!r} (config {self.config!r}, split {self.split!r}) "
                f"on the Hugging Face hub ({type(exc).__name__}: {exc}). {_offline_help(self.name)}"
            ) from exc

    def _check_field(self, fields) -> None:
        if fields is not None and self.text_field not in fields:
            raise DataSourceError(
                f"dataset {self.name!r} has no field {self.text_field!r}; its fields: {', '.join(map(repr, fields))}"
            )

    def _text_of(self, example: dict) -> str | None:
        if self.text_field not in example:
            self._check_field(list(example))
        return example[self.text_field]

    def _part_of_dataset(self, part: int, num_parts: int, hf_state: dict | None):
        from datasets.distributed import split_dataset_by_node

        # A fresh object per pass: once load_state_dict() was called on an IterableDataset, every later
        # iteration of that object starts from the loaded state again, never from the beginning.
        dataset = split_dataset_by_node(self._dataset, rank=part, world_size=num_parts)
        if hf_state is not None:
            dataset.load_state_dict(hf_state)
        return dataset

    def documents(self, part: int, num_parts: int, state: dict | None = None) -> Iterator[tuple[str, dict]]:
        _check_part(part, num_parts)
        epoch, hf_state = (state["epoch"], state["hf"]) if state else (0, None)
        while True:
            dataset = self._part_of_dataset(part, num_parts, hf_state)
            found = False
            for example in dataset:
                text = self._text_of(example)
                if _is_document(text):
                    found = True
                    # state_dict() is a deep copy taken right after this example: resuming continues after it.
                    yield text, {"epoch": epoch, "hf": dataset.state_dict()}
            if hf_state is None and not found:
                raise EmptyPartError(
                    f"part {part} of {num_parts} (ranks x loader workers) gets no documents from dataset "
                    f"{self.name!r} split {self.split!r}: it is empty, or has fewer documents than parts"
                )
            epoch, hf_state = epoch + 1, None
