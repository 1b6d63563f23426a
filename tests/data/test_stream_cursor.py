"""The global document cursor of streamed sources: resuming at another number of parts (ranks x loader workers)
reads no consumed document again and leaves none out, in the plan logic and through the packing loader."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch

from atma_titan.data.documents import DataSourceError, EmptyPartError, HFDataset, SplitSource, TextFiles
from atma_titan.data.packing import build_text_dataloader, consumed_positions
from atma_titan.data.stream_plan import StreamPlan, Unit

PART_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12)


class MemoryFiles(SplitSource):
    """A tiny in-memory source: files are lists of texts (None or '' = an empty document)."""

    def __init__(self, files: list[list[str | None]]):
        self.files = files

    @property
    def num_files(self) -> int:
        return len(self.files)

    def file_names(self) -> list[str]:
        return [f"file{i}" for i in range(len(self.files))]

    def read(self, file, start=0, modulus=1, residue=0):
        for doc, text in enumerate(self.files[file]):
            if doc >= start and doc % modulus == residue:
                yield doc, text

    def _empty_part_error(self, part, num_parts):
        return EmptyPartError(f"part {part} of {num_parts} is empty")


def corpus(rng: random.Random, num_files: int) -> MemoryFiles:
    """Files of 6-30 documents "f.d", every seventh one empty (empty documents keep their number)."""
    files = []
    for f in range(num_files):
        files.append([None if d % 7 == 3 else f"{f}.{d}" for d in range(rng.randint(6, 30))])
    return MemoryFiles(files)


def all_documents(source: MemoryFiles) -> set[str]:
    return {t for docs in source.files for t in docs if t}


def consume(source, plan, num_parts, budget, rng):
    """Each part reads a random number of its documents (up to `budget`); returns (texts read, positions)."""
    read, positions = [], {}
    for part in range(num_parts):
        taken = list(itertools.islice(source.documents(part, num_parts, plan=plan), rng.randint(0, budget)))
        read += [(state["epoch"], text) for text, state in taken]
        positions[part] = taken[-1][1] if taken else None
    return read, positions


def consumed_by_plan(source: MemoryFiles, plan: StreamPlan, epoch: int) -> set[str]:
    """The documents of pass `epoch` that the plan's cursors say are consumed."""
    out = set()
    for unit in plan.units:
        for doc, text in source.read(unit.file, 0, unit.modulus, unit.residue):
            if text and (epoch, doc) < unit.cursor:
                out.add(text)
    return out


# ---------------------------------------------------------------- the plan


def test_fresh_plan_splits_whole_files_or_refines_evenly():
    plan = StreamPlan.fresh(5)
    assert plan.split(3) is plan and list(plan.units_of(1, 3)) == [1, 4]
    refined = plan.split(7)  # 5 files, 7 parts: every file in 7 residues, 5 units a part
    assert len(refined.units) == 35 and all(u.modulus == 7 for u in refined.units)
    for f in range(5):
        assert sorted(u.residue for u in refined.units if u.file == f) == list(range(7))
    assert {len(refined.units_of(p, 7)) for p in range(7)} == {5}
    assert refined.split(20) is refined  # enough units: no refinement
    again = refined.split(70)  # a refined unit is refined again: residues r and r + 7 mod 14
    assert sorted(u.residue for u in again.units if u.file == 0) == list(range(14))


def test_refining_keeps_each_units_cursor_and_the_consumed_set():
    source = corpus(random.Random(0), 2)
    plan = StreamPlan.fresh(2).advanced({0: {"epoch": 0, "unit": 0, "doc": 5}, 1: None}, 2)
    assert plan.units[0].cursor == (0, 5) and plan.units[1].cursor == (0, 0)
    before = consumed_by_plan(source, plan, 0)
    assert before == {t for t in source.files[0][:5] if t}
    assert consumed_by_plan(source, plan.split(6), 0) == before


def test_advancing_marks_units_behind_a_position_read_to_the_end():
    plan = StreamPlan.fresh(6).split(2)  # part 0: units 0, 2, 4
    moved = plan.advanced({0: {"epoch": 1, "unit": 2, "doc": 3}}, 2)
    assert [moved.units[u].cursor for u in (0, 2, 4)] == [(2, 0), (1, 3), (1, 0)]
    assert [moved.units[u].cursor for u in (1, 3, 5)] == [(0, 0)] * 3  # part 1 read nothing
    assert moved.saved_parts == 2
    with pytest.raises(ValueError, match="not one of part 1"):
        plan.advanced({1: {"epoch": 0, "unit": 2, "doc": 1}}, 2)


def test_plan_round_trips_through_json_and_refuses_other_files():
    plan = StreamPlan.fresh(3, "abc").split(4).advanced({2: {"epoch": 0, "unit": 6, "doc": 9}}, 4)
    assert StreamPlan.from_json(plan.to_json()) == plan
    assert all(isinstance(u, Unit) for u in StreamPlan.from_json(plan.to_json()).units)
    with pytest.raises(ValueError, match="saved for 3 files, but .* now has 4 files"):
        plan.check_source(4, "abc", "the source")
    with pytest.raises(ValueError, match="same number of files under other names"):
        plan.check_source(3, "xyz", "the source")


@pytest.mark.parametrize("num_files", [1, 2, 5])
def test_any_sequence_of_part_counts_reads_every_document_once_per_pass(num_files):
    """Random consumption at P parts, then P', then P'', ...: the documents read never repeat within a pass,
    and they are exactly those the final cursors call consumed (nothing is left out)."""
    rng = random.Random(num_files)
    for trial in range(40):
        source = corpus(rng, num_files)
        plan = source.fresh_plan()
        read: list[tuple[int, str]] = []
        counts = [rng.choice(PART_COUNTS) for _ in range(rng.randint(2, 5))]
        for num_parts in counts:
            plan = plan.split(num_parts)
            try:
                got, positions = consume(source, plan, num_parts, budget=12, rng=rng)
            except EmptyPartError:  # more parts than a tiny corpus can feed: not what this test is about
                break
            read += got
            plan = plan.advanced(positions, num_parts)
        assert len(read) == len(set(read)), (trial, counts)  # no document twice in one pass
        for epoch in range(max((e for e, _ in read), default=0) + 1):
            assert {t for e, t in read if e == epoch} == consumed_by_plan(source, plan, epoch), (trial, counts)


def test_same_part_count_continues_as_if_uninterrupted():
    source = corpus(random.Random(3), 3)
    plan = source.fresh_plan().split(4)
    for part in range(4):
        straight = list(itertools.islice(source.documents(part, 4, plan=plan), 40))
        for cut in (1, 7, 13, 25):
            moved = plan.advanced({part: straight[cut - 1][1]}, 4)  # a saved plan: the same units, later cursors
            resumed = source.documents(part, 4, straight[cut - 1][1], plan=moved)
            assert list(itertools.islice(resumed, 15)) == straight[cut : cut + 15], (part, cut)


def test_a_pass_that_starts_mid_way_is_not_an_empty_part():
    source = MemoryFiles([["a", "b"], ["c"]])
    plan = StreamPlan.fresh(2).advanced({0: {"epoch": 0, "unit": 0, "doc": 2}}, 1)  # file 0 all read
    assert [t for t, _ in itertools.islice(source.documents(0, 1, plan=plan), 4)] == ["c", "a", "b", "c"]
    with pytest.raises(EmptyPartError):
        next(MemoryFiles([[None], [""]]).documents(0, 1))


# ---------------------------------------------------------------- through the packing loader


class IdTokenizer:
    """Document "<id> <n>" -> [id + 2] + [1] * n, EOT 0: the token after each EOT names its document."""

    name, vocab_size, eot_id = "ids", 1000, 0

    def encode(self, text: str) -> list[int]:
        doc, length = map(int, text.split())
        return [doc + 2] + [1] * length

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def id_corpus(folder, num_files: int, docs: int, seed: int = 0) -> dict[int, int]:
    """jsonl files of documents "<id> <n>"; returns id -> token count (EOT excluded)."""
    rng, lengths, ids = random.Random(seed), {}, iter(range(10**6))
    for f in range(num_files):
        with open(folder / f"f{f}.jsonl", "w") as out:
            for _ in range(docs):
                doc, n = next(ids), rng.randint(0, 40)
                lengths[doc] = n + 1
                out.write(json.dumps({"text": f"{doc} {n}"}) + "\n")
    return lengths


def trained(batches, num_workers: int = 1):
    """(ids of the documents whose EOT was an input token, id -> its tokens trained) over one rank's consumed
    micro-batches. Batch i comes from loader worker i mod num_workers (the loader takes them in turn)."""
    started, tokens = [], {}
    for worker in range(num_workers):
        ours = batches[worker::num_workers]
        windows = [np.append(x, y[-1]) for inputs, labels in ours for x, y in zip(inputs.numpy(), labels.numpy())]
        if not windows:
            continue
        stream = np.concatenate([windows[0], *(w[1:] for w in windows[1:])])  # consecutive windows share a token
        eots = np.flatnonzero(stream == IdTokenizer.eot_id)
        for start, end in zip(eots, [*eots[1:], len(stream)]):
            if start < len(stream) - 1:  # the last token was only a label: a document starting there is not read
                started.append(int(stream[start + 1]) - 2)
                tokens[started[-1]] = int(end - start - 1)
    return started, tokens


def run_segment(source, plan, world_size, micro_batches, num_workers=0, seq_len=16):
    """Every rank's loader at `world_size`, `micro_batches` each; returns (started, tokens, plan after)."""
    started, tokens, positions = [], {}, {}
    for rank in range(world_size):
        loader = build_text_dataloader(
            source, IdTokenizer(), seq_len, 2, rank=rank, world_size=world_size, num_workers=num_workers,
            tokenize_batch=3, plan=plan,
        )  # fmt: skip
        it = iter(loader)
        got, counts = trained([next(it) for _ in range(micro_batches)], max(num_workers, 1))
        started += got
        tokens.update(counts)
        positions.update(consumed_positions(loader))
    return started, tokens, plan.advanced(positions, world_size * max(num_workers, 1))


@pytest.mark.parametrize("sizes", [(2, 1, 2), (1, 3, 2), (4, 3, 1, 2), (3, 5, 4)])
@pytest.mark.parametrize("num_files", [1, 3, 4])
def test_packed_stream_at_other_world_sizes_repeats_nothing_and_loses_one_tail_per_part(tmp_path, sizes, num_files):
    lengths = id_corpus(tmp_path, num_files, docs=200, seed=num_files)  # no unit runs into its second pass
    source = TextFiles(str(tmp_path / "*.jsonl"))
    plan, started, tokens = source.fresh_plan(), [], {}
    for world in sizes:
        plan = plan.split(world)
        got, counts, plan = run_segment(source, plan, world, micro_batches=6)
        started += got
        tokens.update(counts)  # a document consumed in two segments would show up twice in `started`
    assert len(started) == len(set(started)), sizes  # no document trained twice
    # Nothing left out: the documents trained are exactly those behind the final cursors.
    behind = set()
    for unit in plan.units:
        for doc, text in source.read(unit.file, 0, unit.modulus, unit.residue):
            if (0, doc) < unit.cursor:
                behind.add(int(text.split()[0]))
    assert set(started) == behind
    # The bound: only a document being packed at a change of size loses the rest of its tokens, one per old part.
    cut = [d for d in started if tokens[d] < lengths[d]]
    assert len(cut) <= sum(sizes), (sizes, cut)


def test_loader_workers_are_parts_too(tmp_path):
    """A change of loader workers at the same world size also continues from the cursor."""
    id_corpus(tmp_path, 2, docs=50)
    source = TextFiles(str(tmp_path / "*.jsonl"))
    plan = source.fresh_plan().split(2)
    first, _, plan = run_segment(source, plan, 1, micro_batches=8, num_workers=2)
    assert plan.saved_parts == 2 and all(u.cursor > (0, 0) for u in plan.units)
    second, _, plan = run_segment(source, plan.split(1), 1, micro_batches=8)
    assert first and second and not set(first) & set(second)


def test_exact_state_and_cursor_agree_at_the_same_world_size(tmp_path):
    """The per-rank state still restores bit for bit under a plan read back from the checkpoint."""
    id_corpus(tmp_path, 3, docs=40)
    source = TextFiles(str(tmp_path / "*.jsonl"))
    plan = source.fresh_plan().split(2)

    def loader(plan):
        return build_text_dataloader(source, IdTokenizer(), 16, 2, rank=1, world_size=2, tokenize_batch=3, plan=plan)

    straight = loader(plan)
    it = iter(straight)
    [next(it) for _ in range(5)]
    state, saved_plan = straight.state_dict(), plan.advanced(consumed_positions(straight), 2)
    expected = [next(it) for _ in range(8)]
    resumed = loader(StreamPlan.from_json(saved_plan.to_json()))
    resumed.load_state_dict(state)
    got = list(itertools.islice(iter(resumed), 8))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expected, got))


def test_hf_dataset_continues_from_the_same_cursor_as_text_files(tmp_path):
    pytest.importorskip("datasets")
    id_corpus(tmp_path, 3, docs=30)
    hf, files = HFDataset(str(tmp_path)), TextFiles(str(tmp_path / "*.jsonl"))
    assert hf.num_files == files.num_files == 3
    plan = files.fresh_plan().split(2)
    _, _, plan = run_segment(files, plan, 2, micro_batches=5)
    plan = plan.split(4)  # 3 shards, 4 parts: refined
    hf_plan = StreamPlan(plan.units, hf.num_files, hf.fingerprint(), plan.saved_parts)
    for part in range(4):
        a = list(itertools.islice(hf.documents(part, 4, plan=hf_plan), 12))
        b = list(itertools.islice(files.documents(part, 4, plan=plan), 12))
        assert a == b and a, part
    started, _, _ = run_segment(hf, hf_plan, 4, micro_batches=4)
    assert len(started) == len(set(started))


def test_hf_dataset_in_loader_workers_reads_every_shard(tmp_path):
    """datasets splits a dataset's shards among DataLoader workers on its own; every part must still read
    exactly its units (1 rank x 2 workers of 4 shards: all four shards are read)."""
    pytest.importorskip("datasets")
    id_corpus(tmp_path, 4, docs=3)
    loader = build_text_dataloader(HFDataset(str(tmp_path)), IdTokenizer(), 16, 1, num_workers=2)
    started, _ = trained(list(itertools.islice(iter(loader), 40)), num_workers=2)
    assert set(range(12)) <= set(started)


def test_checkpoint_plan_for_other_files_is_refused(tmp_path):
    id_corpus(tmp_path, 2, docs=5)
    plan = TextFiles(str(tmp_path / "*.jsonl")).fresh_plan()
    (tmp_path / "f2.jsonl").write_text(json.dumps({"text": "99 1"}) + "\n")
    grown = TextFiles(str(tmp_path / "*.jsonl"))
    with pytest.raises(
        DataSourceError, match=r"saved for 2 files, but data.path '.*\*\.jsonl' now has 3 files; .*point data.path"
    ):
        grown.check_plan(plan)
