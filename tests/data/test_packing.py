"""Tests for packing documents into windows and the resumable streaming batch dataset."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from atma_titan.data.documents import HFDataset, TextFiles
from atma_titan.data.packing import Packer, PackedBatches, build_text_dataloader, pack
from atma_titan.data.tokenizer import ByteTokenizer

EOT = 0
BYTES = ByteTokenizer()


def write_jsonl_files(folder, num_files, docs_per_file, long_every=5):
    """jsonl files of unique documents; every `long_every`-th one is longer than a window."""
    all_docs = []
    for f in range(num_files):
        docs = []
        for d in range(docs_per_file):
            text = f"<f{f}d{d}>" + ("lorem ipsum " * 9 if d % long_every == 0 else "x" * (d % 7))
            docs.append(text)
        with open(folder / f"part_{f:02d}.jsonl", "w") as out:
            out.writelines(json.dumps({"text": t}) + "\n" for t in docs)
        all_docs += docs
    return all_docs


def windows_of(batches) -> list[np.ndarray]:
    """The packed windows behind (inputs, labels) micro-batches: inputs plus the last label."""
    return [np.append(row, lab[-1]) for inputs, labels in batches for row, lab in zip(inputs.numpy(), labels.numpy())]


def stream_of(windows) -> np.ndarray:
    """Undo the one-token overlap of consecutive windows."""
    return np.concatenate([windows[0], *(w[1:] for w in windows[1:])])


def decoded_documents(windows, tokenizer=BYTES) -> list[str]:
    """Texts of the documents that start and end inside the windows' stream."""
    stream = stream_of(windows).tolist()
    starts = [i for i, t in enumerate(stream) if t == tokenizer.eot_id]
    return [tokenizer.decode(stream[a + 1 : b]) for a, b in zip(starts, starts[1:])]


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def same_batches(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


# ---------------------------------------------------------------- pack


def test_pack_layout_eot_before_documents_and_shared_boundary():
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    windows = list(pack(docs, 5, EOT))
    # stream: 0 1 2 3 0 4 5 6 7 8 0 9 10; window k covers tokens 4k .. 4k+4
    assert [w.tolist() for w, _ in windows] == [[0, 1, 2, 3, 0], [0, 4, 5, 6, 7], [7, 8, 0, 9, 10]]
    assert [m.tolist() for _, m in windows] == [
        [True, False, False, False, True],
        [True, False, False, False, False],
        [False, False, True, False, False],
    ]
    assert all(w.dtype == np.int64 and m.dtype == bool for w, m in windows)
    assert stream_of([w for w, _ in windows]).tolist() == [0, 1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 9, 10]


def test_pack_matches_the_shard_window_rule_on_random_documents():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, size=rng.integers(0, 30)).tolist() for _ in range(200)]
    stream = np.concatenate([[EOT, *d] for d in docs])
    is_start = np.concatenate([[True] + [False] * len(d) for d in docs])
    length = 17
    windows = list(pack(docs, length, EOT))
    assert len(windows) == (len(stream) - 1) // (length - 1)  # every full window, none partial
    for k, (window, mask) in enumerate(windows):
        first = k * (length - 1)
        assert np.array_equal(window, stream[first : first + length])
        assert np.array_equal(mask, is_start[first : first + length])


def test_pack_continues_from_a_carry():
    rng = np.random.default_rng(1)
    docs = [rng.integers(1, 50, size=rng.integers(1, 40)).tolist() for _ in range(60)]
    whole = list(pack(docs, 9, EOT))
    packer = Packer(9, EOT)
    first = []
    for d in docs[:25]:
        packer.add_document(d)
        while (w := packer.next_window()) is not None:
            first.append(w)
    again = list(pack(docs[25:], 9, EOT, carry=packer.carry))
    assert len(first) + len(again) == len(whole)
    for (a, am), (b, bm) in zip(first + again, whole):
        assert np.array_equal(a, b) and np.array_equal(am, bm)
    assert packer.carry_doc_starts == [i for i, t in enumerate(packer.carry) if t == EOT]


def test_pack_rejects_windows_too_short_to_overlap():
    with pytest.raises(ValueError, match="window length must be >= 2"):
        list(pack([[1]], 1, EOT))


# ---------------------------------------------------------------- PackedBatches


@pytest.fixture
def corpus(tmp_path):
    return str(tmp_path / "part_*.jsonl"), write_jsonl_files(tmp_path, num_files=4, docs_per_file=12)


def test_batches_are_shifted_windows_of_the_document_stream(corpus):
    pattern, all_docs = corpus
    batches = take(build_text_dataloader(TextFiles(pattern), BYTES, seq_len=32, micro_batch=3), 30)
    inputs, labels = batches[0]
    assert inputs.shape == labels.shape == (3, 32) and inputs.dtype == labels.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    stream = stream_of(windows_of(batches))
    expected = np.concatenate([[BYTES.eot_id, *BYTES.encode(d)] for d in all_docs])
    n = min(len(stream), len(expected))
    assert n > len(expected) // 2 and np.array_equal(stream[:n], expected[:n])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_with_stateful_dataloader(corpus, num_workers):
    pattern, _ = corpus
    source = TextFiles(pattern)

    def loader():  # tokenize_batch 3: documents read ahead must not leak into the state
        return build_text_dataloader(source, BYTES, 24, 2, num_workers=num_workers, tokenize_batch=3)

    expected = take(loader(), 60)  # more than one pass over the data
    assert sum(len(x) for x, _ in expected) * 23 > sum(len(d) + 1 for d in corpus[1])
    running = loader()
    it, consumed = iter(running), 0
    for stop in (0, 7, 8, 23, 41):
        while consumed < stop:
            assert same_batches([next(it)], expected[consumed : consumed + 1])
            consumed += 1
        resumed = loader()
        resumed.load_state_dict(running.state_dict())
        assert same_batches(take(resumed, 12), expected[stop : stop + 12]), f"stop={stop}"


def test_two_ranks_read_disjoint_documents(tmp_path):
    for num_files in (4, 1):  # whole files per rank, then documents within one file
        folder = tmp_path / f"f{num_files}"
        folder.mkdir()
        all_docs = write_jsonl_files(folder, num_files, docs_per_file=48 // num_files)
        per_rank = []
        for rank in range(2):
            loader = build_text_dataloader(TextFiles(str(folder)), BYTES, 40, 2, rank=rank, world_size=2)
            per_rank.append(set(decoded_documents(windows_of(take(loader, 60)))))
        assert not per_rank[0] & per_rank[1]
        assert per_rank[0] | per_rank[1] == set(all_docs), f"{num_files} files"


def test_restore_with_other_world_size_is_refused(corpus):
    source = TextFiles(corpus[0])
    loader = build_text_dataloader(source, BYTES, 16, 2, rank=1, world_size=2)
    take(loader, 2)
    state = loader.state_dict()
    other = build_text_dataloader(source, BYTES, 16, 2, rank=0, world_size=1)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved by part 1 of 2 .* this is part 0 of 1"):
        take(other, 1)


def test_state_holds_the_carry_and_no_read_ahead(corpus):
    dataset = PackedBatches(TextFiles(corpus[0]), BYTES, seq_len=16, micro_batch=1, tokenize_batch=8)
    it = iter(dataset)
    next(it)
    state = dataset.state_dict()
    # The first document (longer than a window) is in the packer: the state points right after it,
    # and the carry starts with the last token of the window just yielded.
    assert state["source"] == {"epoch": 0, "unit": 0, "doc": 1}
    assert state["part"] == 0 and state["num_parts"] == 1
    first_doc = [BYTES.eot_id, *BYTES.encode(corpus[1][0])]
    assert state["carry"] == first_doc[16:] and state["carry_doc_starts"] == []


# ---------------------------------------------------------------- Hugging Face datasets (local, offline)


def test_hf_dataset_matches_text_files_and_resumes(tmp_path):
    pytest.importorskip("datasets")
    all_docs = write_jsonl_files(tmp_path, num_files=4, docs_per_file=5)
    hf, files = HFDataset(str(tmp_path)), TextFiles(str(tmp_path))
    for num_parts in (1, 2, 4):  # whole shards per part, as TextFiles splits files
        for part in range(num_parts):
            hf_docs = list(itertools.islice(hf.documents(part, num_parts), 25))
            file_docs = list(itertools.islice(files.documents(part, num_parts), 25))
            assert [t for t, _ in hf_docs] == [t for t, _ in file_docs]
    stream = list(itertools.islice(hf.documents(0, 1), 30))  # across the end of a pass
    assert [t for t, _ in stream[:20]] == all_docs and stream[20][1]["epoch"] == 1
    for i in (0, 4, 11, 19, 22):
        resumed = hf.documents(0, 1, stream[i][1])
        assert [next(resumed)[0] for _ in range(3)] == [t for t, _ in stream[i + 1 : i + 4]], f"after {i}"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_hf_dataset_exact_resume_through_the_loader(tmp_path, num_workers):
    pytest.importorskip("datasets")
    write_jsonl_files(tmp_path, num_files=4, docs_per_file=10)
    source = HFDataset(str(tmp_path))  # pickled to the workers with its IterableDataset

    def loader():
        return build_text_dataloader(source, BYTES, 24, 2, num_workers=num_workers, tokenize_batch=4)

    expected = take(loader(), 40)
    running = loader()
    take(running, 13)
    resumed = loader()
    resumed.load_state_dict(running.state_dict())
    assert same_batches(take(resumed, 20), expected[13:33])
