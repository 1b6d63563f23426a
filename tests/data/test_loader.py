import pytest
import torch

from atma_titan.data import SyntheticSource
from atma_titan.data.loader import RankBatches, build_dataloader

SOURCE = SyntheticSource(vocab_size=128, seed=5)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_labels_are_inputs_shifted_by_one():
    inputs, labels = next(iter(build_dataloader(SOURCE, 16, global_batch=4, micro_batch=2)))
    assert inputs.shape == labels.shape == (2, 16) and inputs.dtype == torch.int64
    window = torch.from_numpy(SOURCE.window(0, 17))
    assert torch.equal(inputs[0], window[:-1]) and torch.equal(labels[0], window[1:])


def test_ranks_split_each_global_batch_into_disjoint_slices():
    single = torch.cat([x for x, _ in take(build_dataloader(SOURCE, 8, 8, 2), 8)])  # 2 steps of 8
    for world in (2, 4):
        per_rank = [
            torch.cat([x for x, _ in take(build_dataloader(SOURCE, 8, 8, 2, rank=r, world_size=world), 8 // world)])
            for r in range(world)
        ]
        for step in range(2):  # each step's global batch is the rank slices, concatenated
            rows = torch.cat([p[step * 8 // world : (step + 1) * 8 // world] for p in per_rank])
            assert torch.equal(rows, single[step * 8 : (step + 1) * 8])


def test_workers_do_not_change_the_batches():
    plain = take(build_dataloader(SOURCE, 8, 8, 2), 6)
    workers = take(build_dataloader(SOURCE, 8, 8, 2, num_workers=2), 6)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(plain, workers))


def test_start_window_resumes_the_stream():
    full = take(build_dataloader(SOURCE, 8, 4, 2), 6)
    resumed = take(build_dataloader(SOURCE, 8, 4, 2, start_window=8), 2)  # after 2 steps of 4
    assert torch.equal(resumed[0][0], full[4][0]) and torch.equal(resumed[1][0], full[5][0])


def test_global_index_mapping():
    ds = RankBatches(SOURCE, 8, global_batch=8, micro_batch=2, rank=1, world_size=2)
    assert [ds.global_index(s) for s in range(6)] == [4, 5, 6, 7, 12, 13]
    shifted = RankBatches(SOURCE, 8, global_batch=8, micro_batch=2, rank=1, world_size=2, start_window=3)
    assert [shifted.global_index(s) for s in range(3)] == [7, 8, 9]  # resumes after any window count


def test_loader_state_resumes_exactly_with_and_without_workers():
    for workers in (0, 2):
        loader = build_dataloader(SOURCE, 8, 4, 2, num_workers=workers)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        expected = [next(it)[0] for _ in range(3)]
        resumed = build_dataloader(SOURCE, 8, 4, 2, num_workers=workers)
        resumed.load_state_dict(state)
        it2 = iter(resumed)
        got = [next(it2)[0] for _ in range(3)]
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), f"workers={workers}"


def test_recall_weight_marks_the_recall_labels():
    inputs, labels, weights = next(iter(build_dataloader(SOURCE, 64, global_batch=4, micro_batch=4, recall_weight=7.5)))
    assert weights.shape == labels.shape and weights.dtype == torch.float32
    for row in range(4):
        window, mask = SOURCE.window_with_recall_mask(row, 65)
        assert torch.equal(labels[row], torch.from_numpy(window[1:]))
        expected = torch.where(torch.from_numpy(mask[1:]), 7.5, 1.0)
        assert torch.equal(weights[row], expected)
    assert (weights == 7.5).any() and (weights == 1.0).any()


def test_recall_weight_needs_a_source_with_recall_records():
    class Plain:
        def window(self, index, length):
            return SOURCE.window(index, length)

    with pytest.raises(ValueError, match="recall records"):
        RankBatches(Plain(), 8, 4, 2, recall_weight=2.0)
