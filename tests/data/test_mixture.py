"""A mixture's draw of each window's source (`data.mixture`) and the loader that feeds it (`data.mixture_batches`):
the realised shares follow the weights, a stage switches them at its first window, and the global stream of
windows is the same at any world size and number of loader workers."""

import numpy as np
import pytest
import torch

from atma_titan.config.sections import Data
from atma_titan.data import SyntheticSource
from atma_titan.data.build import TrainData
from atma_titan.data.mixture import MixtureSchedule, parse_mixture
from atma_titan.data.mixture_batches import build_mixture_dataloader
from atma_titan.data.mixture_data import open_train_data
from atma_titan.data.shards import BinShards, write_shard
from atma_titan.utils.errors import ConfigError


def spec_of(weights: dict, stages=(), steps: int = 100, seed: int = 99):
    sources = [{"name": name, "source": "synthetic", "weight": w} for name, w in weights.items()]
    return parse_mixture(Data(sources=sources, stages=list(stages), seed=seed), steps)


def test_realised_shares_are_the_weights_within_sampling_error():
    weights = {"a": 5, "b": 3, "c": 2}  # not normalised: shares 0.5, 0.3, 0.2
    n = 200_000
    schedule = MixtureSchedule(spec_of(weights), global_batch=16)
    counts = np.bincount(schedule.sources(0, n), minlength=3)
    for (name, w), count in zip(weights.items(), counts):
        p = w / sum(weights.values())
        sigma = np.sqrt(n * p * (1 - p))
        assert abs(count - n * p) <= 4 * sigma, f"{name}: {count} of {n}, expected {n * p:.0f} +- {4 * sigma:.0f}"
    # The count from the start is the same draw, in chunks (counts_before walks 2^20 windows at a time).
    assert np.array_equal(schedule.counts_before(n), counts)


def test_a_stage_switches_the_weights_at_its_first_window():
    g, k = 12, 5  # the stage trains steps 5.., so its first window is (5 - 1) x 12 = 48
    first = (k - 1) * g
    # Only a before the stage, only b from it: the switch is exactly at window 48.
    solo = MixtureSchedule(spec_of({"a": 1, "b": 0}, [{"name": "late", "start_step": k, "weights": {"b": 1}}]), g)
    sources = solo.sources(0, 200)
    assert np.array_equal(sources, np.r_[np.zeros(first, np.int64), np.ones(200 - first, np.int64)])
    # Mixed weights in both stages: each window's source is its stage's draw of that window, as a schedule of
    # that stage's weights alone would draw it (a function of the seed, the window and the weights only).
    stage = {"name": "late", "start_step": k, "weights": {"a": 1, "b": 4}}
    staged = MixtureSchedule(spec_of({"a": 3, "b": 1}, [stage]), g).sources(0, 4000)
    before = MixtureSchedule(spec_of({"a": 3, "b": 1}), g).sources(0, 4000)
    after = MixtureSchedule(spec_of({"a": 1, "b": 4}), g).sources(0, 4000)
    assert np.array_equal(staged[:first], before[:first]) and np.array_equal(staged[first:], after[first:])
    assert not np.array_equal(before[first:], after[first:])  # the two stages do draw differently
    assert abs(staged[first:].mean() - 0.8) < 0.03 and abs(staged[:first].mean() - 0.25) < 0.15
    # Drawn in pieces, from any first window: the same sources.
    fresh = MixtureSchedule(spec_of({"a": 3, "b": 1}, [stage]), g)
    pieces = np.concatenate([fresh.sources(i, 7) for i in range(91, -1, -7)][::-1])  # last piece first
    assert np.array_equal(pieces, staged[:98])


def test_a_stage_start_fraction_is_a_step_of_the_run():
    spec = spec_of({"a": 1, "b": 1}, [{"name": "anneal", "start": 0.8, "weights": {"b": 1}}], steps=100)
    assert [(s.name, s.start_step) for s in spec.stages] == [("main", 1), ("anneal", 81)]
    assert spec.stage_at(80).name == "main" and spec.stage_at(81).name == "anneal"


def test_the_single_source_form_is_no_mixture():
    assert parse_mixture(Data(), 10) is None
    assert isinstance(open_train_data(Data(), 512, 10), TrainData)
    with pytest.raises(ConfigError, match="data.stages"):  # stages need sources
        parse_mixture(Data(stages=[{"name": "s", "start_step": 2, "weights": {"a": 1}}]), 10)


# ---------------------------------------------------------------------------------------------------------
# The loader at any world size and number of workers

SEQ, GLOBAL, MICRO, STEPS = 16, 8, 2, 3


@pytest.fixture(scope="module")
def three_sources(tmp_path_factory):
    """Two synthetic languages and a .bin shard, in a two-stage mixture (the stage from step 3)."""
    folder = tmp_path_factory.mktemp("shard")
    write_shard(str(folder / "s.bin"), np.random.default_rng(0).integers(0, 512, 4000))
    sources = [SyntheticSource(512, eot_id=256, seed=1), SyntheticSource(512, eot_id=256, seed=2)]
    sources.append(BinShards(str(folder / "s.bin"), vocab_size=512))
    tables = [{"name": n, "source": "synthetic", "weight": w} for n, w in (("x", 3), ("y", 2), ("z", 1))]
    stage = {"name": "two", "start_step": 3, "weights": {"x": 1, "z": 3}}
    spec = parse_mixture(Data(sources=tables, stages=[stage], seed=5), STEPS)
    return spec, sources


def global_stream(spec, sources, world: int, workers: int):
    """The windows every rank's loader gives, in the order training takes them: step s is rank 0's slice, then
    rank 1's, ... (accum micro-batches each)."""
    loaders = [
        iter(
            build_mixture_dataloader(
                MixtureSchedule(spec, GLOBAL), sources, SEQ, GLOBAL, MICRO, names=spec.names, rank=r,
                world_size=world, num_workers=workers,
            )
        )
        for r in range(world)
    ]  # fmt: skip
    accum = GLOBAL // world // MICRO
    batches = [next(loaders[r]) for _ in range(STEPS) for r in range(world) for _ in range(accum)]
    return [torch.cat(parts) for parts in zip(*batches)]  # inputs, labels, sources


def test_the_windows_are_the_same_at_every_world_size_and_number_of_workers(three_sources):
    spec, sources = three_sources
    inputs, labels, drawn = global_stream(spec, sources, 1, 0)
    n = STEPS * GLOBAL
    # What they must be: window i is source s(i)'s own window k, k = how many earlier windows s gave.
    expected_sources = MixtureSchedule(spec, GLOBAL).sources(0, n)
    assert np.array_equal(drawn.numpy(), expected_sources) and set(expected_sources.tolist()) == {0, 1, 2}
    seen = [0, 0, 0]
    for i, s in enumerate(expected_sources.tolist()):
        window = torch.from_numpy(sources[s].window(seen[s], SEQ + 1).astype(np.int64))
        seen[s] += 1
        assert torch.equal(inputs[i], window[:-1]) and torch.equal(labels[i], window[1:]), i
    for world, workers in ((1, 2), (2, 0), (2, 2), (4, 0), (4, 2)):
        got = global_stream(spec, sources, world, workers)
        assert all(torch.equal(a, b) for a, b in zip(got, (inputs, labels, drawn))), (world, workers)
