"""Document sources for the streaming path: text files or a Hugging Face dataset, split and resumable.

A source is a list of *files* (a dataset's shards for ``HFDataset``), each a sequence of
documents numbered 0, 1, 2, ... in file order. Documents whose text is empty or null are
skipped (they carry nothing to learn) but keep their number, so positions and the split do
not depend on them.

Contract (``DocumentSource``): ``documents(part, num_parts, state=None, plan=None)`` yields
``(text, state)`` pairs, forever: after the last document of a pass over this part's data it
starts the next pass (epoch) in the same order. ``num_parts`` is data-parallel ranks x loader
workers per rank (or a prepare run's ``--parts``), and the parts of one pass are disjoint and
together cover every document exactly once. ``state`` is the part's position right after that
document, ``{"epoch", "unit", "doc"}`` (see ``stream_plan``); passing it back as ``state`` resumes
with the next document. A state is only meaningful for the same source, ``plan`` and
``num_parts``.

Which documents a part reads is decided by a ``stream_plan.StreamPlan`` (``plan``; None: the
fresh plan of this source): unit ``i`` of the plan belongs to part ``i mod P``. With at least
``num_parts`` files, part ``p`` reads files ``p, p + P, p + 2P, ...`` whole (no reading of other
parts' files); with fewer, every file is cut into ``k = P / gcd(files, P)`` units by document
number mod k and each part reads ``files * k / P`` of them (``StreamPlan.split`` says which). The
plan also holds every unit's cursor, which the parts' positions advance (``StreamPlan.advanced``),
so a run saved at P parts continues at any P': within a pass, no document behind a cursor is
read again and none ahead of it is left out. What the trainer counts as consumed, and so what
a change of split can lose (at most the untrained rest of one document per old part), is
``packing``'s. A part that gets no document at all in a full pass raises ``EmptyPartError``
instead of looping forever.

``TextFiles(pattern, text_field)``: the files matching a local path, glob or directory, or
any fsspec URL or URL glob (``s3://bucket/data/*.jsonl.gz``, ``memory://...``), sorted
by name. By extension:

* ``.txt``: the whole file is one document (UTF-8; invalid bytes become U+FFFD);
* ``.jsonl``: one JSON object per line, the document is its ``text_field``; blank lines
  are ignored (they are not documents);
* ``.parquet``: column ``text_field``, read one row group at a time with pyarrow;
* ``.txt`` and ``.jsonl`` may be compressed: ``.gz``, ``.bz2``, ``.xz``, ``.zst`` (the
  last needs the ``zstandard`` package).

``HFDataset(name, config, split, text_field)``: ``datasets.load_dataset(..., streaming=True)``
of a hub id or a local directory/loader name (``"json"`` with ``data_files``); its files are the
streamed dataset's shards, each read alone (``split_dataset_by_node`` with one node per shard).
A resume inside a shard skips the examples before the cursor by reading them: the
``IterableDataset``'s own ``state_dict()`` cannot be used, since it describes a position in one
node's share of the shards and cannot be re-split for another number of nodes.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Protocol, runtime_checkable

import xxhash

from atma_titan.data.stream_plan import StreamPlan
from atma_titan.utils.errors import InputError, import_optional

__all__ = ["DataSourceError", "DocumentSource", "EmptyPartError", "HFDataset", "SplitSource", "TextFiles"]

# What decides which documents a part gets; prepare records it with its plan, so a change of
# the split rule is never mixed into a half-written output folder.
SPLIT_VERSION = 2


class DataSourceError(InputError):
    """A document source cannot be read: no files, a bad file, a missing field, an unreachable dataset."""


class EmptyPartError(DataSourceError):
    """A part (of ranks x loader workers, or of a prepare run) in which a full pass finds no document."""


@runtime_checkable
class DocumentSource(Protocol):
    def documents(
        self, part: int, num_parts: int, state: dict | None = None, plan: StreamPlan | None = None
    ) -> Iterator[tuple[str, dict]]:
        """Yield (text, state after this document) for this part, pass after pass; resume after ``state``."""
        ...


def _check_part(part: int, num_parts: int) -> None:
    if num_parts < 1 or not 0 <= part < num_parts:
        raise ValueError(f"part must be in [0, num_parts), got part {part} of {num_parts}")


def _is_document(text) -> bool:
    return text is not None and text != ""


def _first_kept(start: int, modulus: int, residue: int) -> int:
    """The smallest document number >= start with number % modulus == residue."""
    return start + (residue - start) % modulus


class SplitSource:
    """The split and the passes over a list of files, shared by TextFiles and HFDataset.

    A subclass provides ``num_files``, ``file_names()`` and ``read(file, start, modulus, residue)``,
    which yields ``(number, text or None)`` for the documents of one file numbered >= start with
    number % modulus == residue, and ``_empty_part_error``.
    """

    num_files: int

    def file_names(self) -> list[str]:
        raise NotImplementedError

    def read(self, file: int, start: int = 0, modulus: int = 1, residue: int = 0) -> Iterator[tuple[int, str | None]]:
        raise NotImplementedError

    def _empty_part_error(self, part: int, num_parts: int) -> DataSourceError:
        raise NotImplementedError

    def describe(self) -> str:
        """The source as a message names it."""
        return repr(self)

    def fingerprint(self) -> str:
        """A hash of the file names in order: a plan saved for other files is refused."""
        return xxhash.xxh64("\n".join(self.file_names()).encode()).hexdigest()

    def fresh_plan(self) -> StreamPlan:
        return StreamPlan.fresh(self.num_files, self.fingerprint())

    def check_plan(self, plan: StreamPlan) -> None:
        """Raise DataSourceError when `plan` was saved for other files than these."""
        try:
            plan.check_source(self.num_files, self.fingerprint(), self.describe())
        except ValueError as exc:
            raise DataSourceError(
                f"{exc}; the stream cannot continue on other data: point data.path at the files the run was "
                "trained on, or start a new run from its weights (checkpoint.load_path with checkpoint.model_only)"
            ) from None

    def documents(
        self, part: int, num_parts: int, state: dict | None = None, plan: StreamPlan | None = None
    ) -> Iterator[tuple[str, dict]]:
        _check_part(part, num_parts)
        plan = (plan or self.fresh_plan()).split(num_parts)
        mine = plan.units_of(part, num_parts)
        if state is not None and state["unit"] % num_parts != part:
            raise ValueError(f"state {state} belongs to another part than part {part} of {num_parts}")
        epoch = state["epoch"] if state is not None else plan.first_epoch(part, num_parts)
        while True:
            full, found = True, False  # full: every unit read from its first document in this pass
            for u in mine:
                unit = plan.units[u]
                start = unit.first_in_pass(epoch)
                if state is not None:  # the first pass of a resume starts at the position
                    if u < state["unit"]:
                        start = None
                    elif u == state["unit"] and start is not None:
                        start = max(start, state["doc"])
                if start is None or start > 0:
                    full = False
                if start is None:
                    continue
                for doc, text in self.read(unit.file, start, unit.modulus, unit.residue):
                    if _is_document(text):
                        found = True
                        yield text, {"epoch": epoch, "unit": u, "doc": doc + 1}
            if full and not found:
                raise self._empty_part_error(part, num_parts)
            state, epoch = None, epoch + 1


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


def _read_txt(url: str, compression: str | None, text_field: str, start: int, modulus: int, residue: int):
    if start > 0 or residue != 0:  # the file's only document (number 0) is not asked for
        return
    with _open_binary(url, compression) as f:
        yield 0, f.read().decode("utf-8", errors="replace")


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


def _read_jsonl(url: str, compression: str | None, text_field: str, start: int, modulus: int, residue: int):
    index = 0  # documents = non-blank lines; blank lines are not documents
    with _open_binary(url, compression) as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if index >= start and index % modulus == residue:  # other lines are not even parsed
                yield index, _jsonl_text(url, line_number, line, text_field)
            index += 1


def _read_parquet(url: str, compression: str | None, text_field: str, start: int, modulus: int, residue: int):
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
            first = _first_kept(max(start, first_row), modulus, residue)
            if first < first_row + rows:  # row groups holding no wanted row are not read
                texts = parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist()
                yield from zip(range(first, first_row + rows, modulus), texts[first - first_row :: modulus])
            first_row += rows


_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}


class TextFiles(SplitSource):
    """Documents from text, JSON-lines or parquet files (see the module docstring for the contract)."""

    def __init__(self, pattern: str, text_field: str = "text"):
        self.pattern, self.text_field = pattern, text_field
        self.files = _match_files(pattern)
        self._kinds = [_file_kind(url) for url in self.files]  # an unknown extension fails here, early

    def __repr__(self) -> str:
        return f"TextFiles({self.pattern!r}, text_field={self.text_field!r}; {len(self.files)} files)"

    @property
    def num_files(self) -> int:
        return len(self.files)

    def describe(self) -> str:
        return f"data.path {self.pattern!r}"

    def file_names(self) -> list[str]:
        # Base names: the same files moved to another folder or bucket are the same data.
        return [url.rstrip("/").rsplit("/", 1)[-1] for url in self.files]

    def read(self, file: int, start: int = 0, modulus: int = 1, residue: int = 0) -> Iterator[tuple[int, str | None]]:
        fmt, compression = self._kinds[file]
        return _READERS[fmt](self.files[file], compression, self.text_field, start, modulus, residue)

    def count_documents(self) -> int:
        """Non-empty documents in all files (reads everything; used to explain an empty part)."""
        return sum(_is_document(text) for i in range(len(self.files)) for _, text in self.read(i))

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


_HF_BATCH = 256  # examples per read from a shard: cheaper than one by one, also when skipping to a cursor


class HFDataset(SplitSource):
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
        datasets = import_optional("datasets", "data", "data.source = 'hf'")
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

    def describe(self) -> str:
        return f"the dataset {self.name!r} (split {self.split!r})"

    @property
    def num_files(self) -> int:
        dataset = self._dataset
        return int(dataset.num_shards if hasattr(dataset, "num_shards") else dataset.n_shards)

    def file_names(self) -> list[str]:
        # Shards have no names we can rely on; their count (checked apart) and the split identify them.
        return [f"{self.config or ''}/{self.split}"]

    def _check_field(self, fields) -> None:
        if fields is not None and self.text_field not in fields:
            raise DataSourceError(
                f"dataset {self.name!r} has no field {self.text_field!r}; its fields: {', '.join(map(repr, fields))}"
            )

    def _texts_of(self, batch: dict) -> list:
        if self.text_field not in batch:
            self._check_field(list(batch))
        return batch[self.text_field]

    def read(self, file: int, start: int = 0, modulus: int = 1, residue: int = 0) -> Iterator[tuple[int, str | None]]:
        from datasets.distributed import split_dataset_by_node

        # One node per shard: node `file` reads exactly shard `file`, whole and in order. `iter()` and not
        # `__iter__`: in a DataLoader worker the latter would split the shard again among the workers.
        shard = split_dataset_by_node(self._dataset, rank=file, world_size=self.num_files)
        wanted, number = _first_kept(start, modulus, residue), 0
        for batch in shard.iter(batch_size=_HF_BATCH):
            texts = self._texts_of(batch)
            end = number + len(texts)
            while wanted < end:
                yield wanted, texts[wanted - number]
                wanted += modulus
            number = end

    def _empty_part_error(self, part: int, num_parts: int) -> DataSourceError:
        return EmptyPartError(
            f"part {part} of {num_parts} (ranks x loader workers) gets no documents from dataset "
            f"{self.name!r} split {self.split!r}: it is empty, or has fewer documents than parts"
        )
