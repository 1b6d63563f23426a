"""The hang and straggler watchdog (atma_titan/run/watchdog.py): its judgement on a fake clock, its dump and
exit, and two ranks under torchrun where one straggles inside a step."""

import os
import threading
import time
from pathlib import Path

import pytest

from atma_titan.config import ConfigError, load_config
from atma_titan.run.watchdog import HANG_EXIT, KEEP_HANGS, MIN_SAMPLES, WARMUP_STEPS, Watchdog, prune
from distributed_utils import TINY, losses, run_trainer


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watchdog(tmp_path, clock, exits, **kwargs) -> Watchdog:
    options = dict(slow_factor=5.0, min_seconds=3.0, clock=clock, exit=exits.append, poll_s=0.005, exit_delay_s=0)
    return Watchdog(tmp_path, 1, **{**options, **kwargs})


def run_steps(wd: Watchdog, clock: Clock, seconds: list[float], after_s: float = 0.0) -> int:
    """Steps 1.. of the given lengths, `after_s` between them (validation, saves); returns the next step."""
    for step, length in enumerate(seconds, 1):
        wd.step_started(step)
        clock.now += length
        wd.step_ended()
        clock.now += after_s
    return len(seconds) + 1


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_a_step_far_slower_than_the_median_is_a_hang(tmp_path):
    clock, exits = Clock(), []
    wd = watchdog(tmp_path, clock, exits)
    # the compiling first steps are slow and left out; a validation of 500 s after every step is not step time
    step = run_steps(wd, clock, [300.0] * WARMUP_STEPS + [0.2, 0.4, 0.5, 0.4, 0.3, 0.4], after_s=500.0)
    assert wd.limit() == 3.0  # max(min_seconds, 5 x median 0.4)
    wd.step_started(step)
    clock.now += 2.9
    assert wd.check() is None  # above 5 x the median, but not above min_seconds
    clock.now += 0.2
    hang = wd.check()
    assert hang.step == step and hang.ran_s == pytest.approx(3.1) and hang.median_s == pytest.approx(0.4)
    assert hang.samples == 6 and "rank 1: step 10 has run 3.1 s, 8x the median step of 0.4 s" in hang.describe(1)


def test_slow_factor_judges_once_the_median_times_it_passes_min_seconds(tmp_path):
    clock, exits = Clock(), []
    wd = watchdog(tmp_path, clock, exits, min_seconds=1.0)
    step = run_steps(wd, clock, [1.0] * (WARMUP_STEPS + MIN_SAMPLES))
    assert wd.limit() == 5.0
    wd.step_started(step)
    clock.now += 4.5
    assert wd.check() is None
    clock.now += 1.0
    assert wd.check() is not None


def test_nothing_is_judged_before_enough_steps_or_between_steps(tmp_path):
    clock, exits = Clock(), []
    wd = watchdog(tmp_path, clock, exits)
    step = run_steps(wd, clock, [0.1] * (WARMUP_STEPS + MIN_SAMPLES - 1))
    wd.step_started(step)
    clock.now += 10_000  # no median yet: a first step of a resumed run may compile for long
    assert wd.limit() is None and wd.check() is None
    wd.step_ended()  # that step is timed: the median now exists, and is robust to its one outlier
    assert wd.limit() == 3.0
    clock.now += 10_000  # a long evaluation or save after the step: no step is running
    assert wd.check() is None
    off = watchdog(tmp_path, clock, exits, slow_factor=0)
    step = run_steps(off, clock, [0.1] * 10)
    off.step_started(step)
    clock.now += 10_000
    assert off.check() is None and off.start()._thread is None


def waiting_in_a_collective(release: threading.Event) -> None:
    release.wait()


def test_the_thread_dumps_every_stack_says_so_and_exits(tmp_path, capfd):
    clock, exits = Clock(), []
    wd = watchdog(tmp_path, clock, exits).start()
    release = threading.Event()
    other = threading.Thread(target=waiting_in_a_collective, args=(release,), daemon=True)
    other.start()
    try:
        step = run_steps(wd, clock, [0.5] * (WARMUP_STEPS + MIN_SAMPLES))
        wd.step_started(step)
        clock.now += 2.0
        time.sleep(0.05)
        assert exits == []
        clock.now += 2.0
        assert wait_for(lambda: exits), "the watchdog did not fire"
    finally:
        release.set()
        wd.stop()
    assert exits == [HANG_EXIT] and wd.fired.step == step
    dump = tmp_path / "hangs" / f"step-{step}.rank-1.txt"
    assert [p.name for p in (tmp_path / "hangs").iterdir()] == [dump.name]
    text = dump.read_text()
    assert text.startswith(f"rank 1: step {step} has run 4.0 s")
    assert "in waiting_in_a_collective" in text and "most recent call first" in text
    err = capfd.readouterr().err
    assert f"watchdog: rank 1: step {step} has run 4.0 s" in err
    assert f"stacks of every thread in {dump}; exiting with status 4" in err


def test_stacks_go_to_stderr_where_the_folder_cannot_be_written(tmp_path, capfd):
    clock, exits = Clock(), []
    (tmp_path / "hangs").write_text("a file where the folder should be")
    wd = watchdog(tmp_path, clock, exits)
    step = run_steps(wd, clock, [0.5] * (WARMUP_STEPS + MIN_SAMPLES))
    wd.step_started(step)
    clock.now += 10.0
    wd._fire(wd.check())
    err = capfd.readouterr().err
    assert exits == [HANG_EXIT] and "most recent call first" in err
    assert f"stacks of every thread in stderr above (writing {tmp_path / 'hangs'}" in err


def test_on_the_real_clock(tmp_path):
    exits = []
    wd = Watchdog(tmp_path, 0, slow_factor=2.0, min_seconds=0.2, exit=exits.append, poll_s=0.02, exit_delay_s=0)
    wd.start()
    try:
        for step in range(1, WARMUP_STEPS + MIN_SAMPLES + 1):
            wd.step_started(step)
            time.sleep(0.01)
            wd.step_ended()
        wd.step_started(step + 1)
        time.sleep(0.1)
        assert exits == []
        assert wait_for(lambda: exits, timeout=3.0)
    finally:
        wd.stop()
    assert 0.2 < wd.fired.ran_s < 1.5 and (tmp_path / "hangs" / f"step-{step + 1}.rank-0.txt").is_file()


def test_old_hang_dumps_are_pruned(tmp_path):
    folder = tmp_path / "hangs"
    folder.mkdir()
    for i, step in enumerate([40, 10, 30, 20, 60, 50]):  # written in this order (a rollback went back to 10)
        for rank in (0, 1):
            path = folder / f"step-{step}.rank-{rank}.txt"
            path.write_text("stacks")
            os.utime(path, (1000 + i, 1000 + i))
    prune(folder, keep_step=70)
    kept = sorted({p.name.split(".")[0] for p in folder.iterdir()})
    assert len(kept) == KEEP_HANGS - 1 and kept == ["step-20", "step-30", "step-50", "step-60"]
    prune(folder, keep_step=20, keep=2)  # the hang being written is kept besides the newest other one
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{s}.rank-{r}.txt" for s in (20, 50) for r in (0, 1)]


@pytest.mark.parametrize(
    "key, value",
    [("parallelism.timeout_s", "0"), ("watchdog.slow_factor", "0.5"), ("watchdog.min_seconds", "-1")]
    + [("debug.sleep_seconds", "-1"), ("debug.sleep_at_step", "-1")],
)
def test_bad_values_are_refused(key, value):
    with pytest.raises(ConfigError, match=key):
        load_config([f"--{key}", value])


def main_thread(dump: Path) -> str:
    (block,) = [b for b in dump.read_text().split("\n\n") if "in train_step" in b]
    return block


@pytest.mark.slow
def test_a_straggling_rank_ends_the_job_with_every_ranks_stacks(tmp_path):
    """Rank 1 sleeps inside step 10 (after its backward); rank 0 waits for it in the step's next collective.
    Both watchdogs fire after min_seconds, each rank dumps where it is, and the job ends with status 4."""
    began = time.monotonic()
    proc = run_trainer(
        2,
        *TINY,
        *["--training.steps", "12", "--job.dump_folder", str(tmp_path), "--parallelism.timeout_s", "120"],
        *["--debug.sleep_at_step", "10", "--debug.sleep_seconds", "90", "--debug.signal_rank", "1"],
        *["--watchdog.slow_factor", "5", "--watchdog.min_seconds", "5"],
        timeout=100,
    )
    elapsed = time.monotonic() - began
    log = proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.returncode != 0, log
    assert elapsed < 80, log  # not the 90 s of the sleep
    hangs = tmp_path / "hangs"
    assert sorted(p.name for p in hangs.iterdir()) == ["step-10.rank-0.txt", "step-10.rank-1.txt"], log
    for rank in (0, 1):
        assert f"watchdog: rank {rank}: step 10 has run" in proc.stderr
        assert f"{hangs / f'step-10.rank-{rank}.txt'}; exiting with status {HANG_EXIT}" in proc.stderr
    # Each file: a header line, then one block per thread; the main thread's is the one through train_step.
    straggler, waiting = (main_thread(hangs / f"step-10.rank-{rank}.txt") for rank in (1, 0))
    assert "in straggle" in straggler and "in after_backward" in straggler
    assert "in straggle" not in waiting and "torch/distributed/" in waiting, waiting  # in a collective
    assert list(losses(tmp_path)) == list(range(1, 10))
