"""Skipped data (data/skips.py): the trainer's position -> the stream's window past the skipped ones, the config's
ranges, the checkpoint's check on a resume, and the loaders (one source, a mixture) at several world sizes.
The trainer runs with data.skip are in tests/train/test_long_runs.py."""

import json
import random

import numpy as np
import pytest
import torch

from atma_titan.config import ConfigError, load_config
from atma_titan.data import SyntheticSource
from atma_titan.data.loader import RankBatches, build_dataloader
from atma_titan.data.mixture_data import open_train_data
from atma_titan.data.skips import SkipState, StreamSkips, skip_pairs
from mixture_tables import two_sources

SOURCE = SyntheticSource(vocab_size=128, seed=5)


def kept(ranges, n: int) -> list[int]:
    """Brute force: the stream 0 .. n - 1 with the windows of the half-open ranges removed."""
    return [i for i in range(n) if not any(a <= i < b for a, b in ranges)]


@pytest.mark.parametrize(
    "ranges",
    [
        [],
        [(0, 1)],  # the very first window
        [(3, 5), (5, 9)],  # adjacent
        [(3, 9), (5, 7)],  # nested
        [(10, 20), (4, 12)],  # overlapping, out of order
        [(2, 3), (4, 5), (6, 7)],  # one window apart
        [(16, 32), (40, 41), (41, 48), (7, 8)],
    ],
)
def test_stream_index_is_the_stream_without_the_skipped_windows(ranges):
    skips = StreamSkips(ranges)
    stream = kept(ranges, 200)
    positions = np.arange(150)
    assert skips.stream_index(positions).tolist() == stream[:150]  # an array
    assert [skips.stream_index(p) for p in range(150)] == stream[:150]  # one int at a time
    assert all(isinstance(skips.stream_index(p), int) for p in (0, 7))


def test_stream_index_matches_brute_force_on_random_ranges():
    rng = random.Random(0)
    for _ in range(200):
        ranges = [(a, a + rng.randint(0, 6)) for a in (rng.randint(0, 60) for _ in range(rng.randint(1, 6)))]
        skips, stream = StreamSkips(ranges), kept(ranges, 200)
        assert skips.stream_index(np.arange(120)).tolist() == stream[:120], ranges
        for a, b in skips.ranges:  # merged: sorted, disjoint, not touching
            assert a < b
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(skips.ranges, skips.ranges[1:])), skips.ranges


def config(**data):
    cfg = load_config([])
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg.data


def test_the_config_counts_steps_and_windows_in_the_streams_numbering():
    g = 8
    skips = StreamSkips.from_config(config(skip=[[3, 4]], skip_windows=[[50, 52]]), g)
    assert skips.ranges == [(16, 32), (50, 53)]  # steps 3..4 are windows [2 G, 4 G); windows 50..52 inclusive
    assert skips.describe(g) == "steps 3..4, windows 50..52"
    assert [skips.stream_step(s, g) for s in range(1, 6)] == [1, 2, 5, 6, 7]
    # adjacent steps and a flat command-line list (--data.skip 2,2,3,3) merge into one range
    assert StreamSkips.from_config(config(skip=[2, 2, 3, 3]), g).ranges == [(8, 24)]
    assert not StreamSkips.from_config(config(), g)


def test_the_command_line_takes_the_tomls_pairs_or_a_flat_list():
    for value in ("[[3, 4], [6, 6]]", "[[3,4],[6,6]]", "3,4,6,6", "[3, 4, 6, 6]"):
        cfg = load_config(["--data.skip", value, "--data.skip_windows", "[[0, 2]]"])
        assert StreamSkips.from_config(cfg.data, 8).ranges == [(0, 3), (16, 32), (40, 48)], value
    with pytest.raises(ConfigError, match=r"'data\.skip' = \[3, 4, 6\]"):
        load_config(["--data.skip", "[[3, 4], [6]]"])


@pytest.mark.parametrize(
    "value, key, low",
    [([[4, 3]], "data.skip", 1), ([[0, 2]], "data.skip", 1), ([3], "data.skip", 1), ([[1, 2, 3]], "data.skip", 1),
     ([[True, 2]], "data.skip", 1), ([[-1, 2]], "data.skip_windows", 0), ([[1.5, 2]], "data.skip_windows", 0)],
)  # fmt: skip
def test_bad_ranges_are_a_config_error_naming_the_key(value, key, low):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        skip_pairs(value, key, low)


def test_good_ranges_read_as_pairs():
    assert skip_pairs([[120, 125], [7, 7]], "data.skip", 1) == [(120, 125), (7, 7)]
    assert skip_pairs([0, 0, 5, 9], "data.skip_windows", 0) == [(0, 0), (5, 9)]
    assert skip_pairs([], "data.skip", 1) == []


def resumed(saved_ranges, position: int, new_ranges) -> None:
    """SkipState.check of a resume with `new_ranges` from a checkpoint that skipped `saved_ranges` and had trained
    `position` windows (through DCP's state_dict / load_state_dict, as the checkpoint does)."""
    saved = SkipState(StreamSkips(saved_ranges)).state_dict()
    state = SkipState(StreamSkips(new_ranges))
    state.load_state_dict(json.loads(json.dumps(saved)))
    state.check(position)


def test_a_resume_may_change_the_ranges_ahead_of_its_position_only():
    # saved: windows 16..31 skipped; 24 windows trained, so the stream stands at window 40
    resumed([(16, 32)], 24, [(16, 32)])  # unchanged
    resumed([(16, 32)], 24, [(16, 32), (40, 48)])  # a range added at the position
    resumed([(16, 32), (56, 64)], 24, [(16, 32), (48, 50)])  # one ahead moved, one ahead dropped
    resumed([], 16, [(16, 24)])  # the first range, starting where the checkpoint stands
    for behind in ([], [(16, 24)], [(8, 32)], [(16, 32), (38, 39)], [(16, 32), (39, 41)]):
        with pytest.raises(ConfigError, match="before the checkpoint's position") as error:
            resumed([(16, 32)], 24, behind)
        assert "data.skip" in str(error.value) and "stream window 40" in str(error.value)
    state = SkipState(StreamSkips([(0, 8)]))  # a checkpoint from before data.skip existed: it skipped nothing
    with pytest.raises(ConfigError, match="before the checkpoint's position"):
        state.check(16)
    SkipState(StreamSkips([(16, 24)])).check(16)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_rank_loader_reads_the_stream_without_the_skipped_windows(world):
    skips = StreamSkips([(3, 5), (16, 24), (27, 28)])
    stream = kept(skips.ranges, 200)
    seq, g, micro, steps = 8, 8, 2, 5
    for rank in range(world):
        ds = RankBatches(SOURCE, seq, g, micro, rank=rank, world_size=world, start_window=6, skips=skips)
        per_rank = g // world
        want = [stream[6 + s * g + rank * per_rank + k] for s in range(steps) for k in range(per_rank)]
        assert [ds.global_index(i) for i in range(steps * per_rank)] == want
        loader = iter(build_dataloader(SOURCE, seq, g, micro, rank=rank, world_size=world, start_window=6, skips=skips))
        rows = torch.cat(
            [torch.cat([x, y[:, -1:]], dim=1) for x, y in (next(loader) for _ in range(len(want) // micro))]
        )
        assert all(torch.equal(row, torch.from_numpy(SOURCE.window(w, seq + 1))) for row, w in zip(rows, want))


MIXTURE = """
[model]
flavor = "debug"

[training]
seq_len = 16
batch_tokens = 128
micro_batch_size = 2
steps = 12

[data]
seed = 3
""" + two_sources(late_step=5)


def mixture_rows(cfg, rank: int, world: int, start: int, count: int, skips=None) -> list[tuple[int, list[int]]]:
    """(source, window) of `count` rows of a rank's mixture loader from trainer position `start`."""
    data = open_train_data(cfg.data, 512, cfg.training.steps)
    loader = iter(
        data.loader(seq_len=16, global_batch=8, micro_batch=2, rank=rank, world_size=world, start_window=start,
                    pin_memory=False, skips=skips)
    )  # fmt: skip
    out = []
    while len(out) < count:
        inputs, labels, sources = next(loader)
        out += [(s, [*i, lab[-1]]) for i, lab, s in zip(inputs.tolist(), labels.tolist(), sources.tolist())]
    return out


@pytest.mark.parametrize("world, start", [(1, 0), (2, 0), (2, 8), (4, 16)])
def test_a_mixture_leaves_the_skipped_windows_out_without_shifting_the_rest(tmp_path, world, start):
    """Each window keeps the source and contents it has in the straight stream (the stage switch too, at stream
    step 5): the skipped windows' draws are left out, not moved on to the next windows."""
    (tmp_path / "mix.toml").write_text(MIXTURE)
    cfg = load_config(["--config", str(tmp_path / "mix.toml")])
    straight = mixture_rows(cfg, 0, 1, 0, 96)
    skips = StreamSkips.from_config(config(skip=[[3, 4]], skip_windows=[[41, 43]]), 8)
    stream = kept(skips.ranges, 96)
    per_rank, steps = 8 // world, 4
    for rank in range(world):
        got = mixture_rows(cfg, rank, world, start, steps * per_rank, skips)
        positions = [start + s * 8 + rank * per_rank + k for s in range(steps) for k in range(per_rank)]
        assert got == [straight[stream[p]] for p in positions], rank
