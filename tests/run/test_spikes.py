"""Loss and gradient-norm spikes (run/spikes.py): the monitor's verdict, and what each spikes.policy does with an
injected spike (--debug.spike_at_step) in a training run."""

import json
import shutil

import numpy as np
import pytest
import torch

from atma_titan.config.sections import Spikes
from atma_titan.run.spikes import SpikeMonitor
from atma_titan.train import main
from distributed_utils import ROOT, TINY, run_trainer

# TINY in this process: the config by its absolute path, and torch's deterministic mode (a process-wide switch)
# left off. Subprocess runs take TINY itself.
_AT = TINY.index("--job.deterministic")
LOCAL = [str(ROOT / a) if a.endswith(".toml") else a for a in TINY[:_AT] + TINY[_AT + 2 :]]

LOSSES = [5.0, 5.2, 4.9, 5.1, 4.8, 5.05, 4.95]
GRADS = [1.0, 1.3, 0.9, 1.1, 1.2, 0.95, 1.05]


def monitor(losses=LOSSES, grads=GRADS, **kw) -> SpikeMonitor:
    """A monitor (policy log, window 10, warmup 5 unless `kw` says otherwise) fed `losses` and `grads` as steps 1..n."""
    m = SpikeMonitor(Spikes(**{"window": 10, "warmup": 5, **kw}))
    for step, (loss, grad) in enumerate(zip(losses, grads), 1):
        assert m.judge(step, loss, grad) is None
    return m


def test_nothing_is_judged_before_the_warmup():
    m = monitor(LOSSES[:4], GRADS[:4])
    assert not m.judging and m.thresholds() == (float("inf"), float("inf"))
    assert m.judge(5, 1e6, 1e6) is None  # the fifth step fills the warmup: not judged, and in the window
    assert m.judging and len(m.losses) == 5
    assert SpikeMonitor(Spikes(policy="off", window=10, warmup=1)).judging is False


def test_a_value_far_above_the_median_spikes_and_stays_out_of_the_window():
    m = monitor()
    window, limits = list(m.losses), m.thresholds()
    spike = m.judge(8, 50.0, 1.1)
    assert spike is not None and spike.step == 8 and spike.loss == 50.0
    assert spike.loss_median == pytest.approx(np.median(LOSSES)) and spike.loss_z > 6 and spike.grad_z < 10
    assert spike.metrics() == {"spike_loss_z": spike.loss_z, "spike_grad_z": spike.grad_z}
    assert "loss 50.0000 (median 5.0000" in spike.describe()
    grad_spike = m.judge(9, 5.0, 40.0)  # the gradient norm alone
    assert grad_spike is not None and grad_spike.grad_z > 10 and grad_spike.loss_z == 0
    assert list(m.losses) == window and m.thresholds() == limits  # neither entered the window
    assert m.judge(10, 5.0, 1.0) is None and len(m.losses) == len(window) + 1
    assert m.judge(11, float("nan"), 1.0) is None and len(m.losses) == len(window) + 1  # the NaN policy's business


def test_the_window_keeps_the_last_window_steps():
    m = monitor([float(i) for i in range(1, 21)], [i / 10 for i in range(1, 21)], warmup=3)  # a slow drift
    assert list(m.losses) == [float(i) for i in range(11, 21)] and list(m.grads) == [i / 10 for i in range(11, 21)]


def test_a_flat_window_does_not_make_every_wiggle_a_spike():
    m = monitor([3.0] * 8, [0.5] * 8)  # median absolute deviation 0: the spread is floored at 0.1% of the median
    loss_limit, grad_limit = m.thresholds()
    assert loss_limit == pytest.approx(3.0 * (1 + 6 * 1e-3), rel=1e-6)
    assert grad_limit == pytest.approx(0.5 * (1 + 10 * 1e-3), rel=1e-6)
    for step, wiggle in enumerate((1e-4, -1e-3, 1e-3, 5e-3), 9):  # relative: well inside 6 (10) floored spreads
        assert m.judge(step, 3.0 * (1 + wiggle), 0.5 * (1 + wiggle)) is None, wiggle
    assert m.judge(20, 3.5, 0.5) is not None  # a real jump still is one
    assert m.judge(21, 3.0, 0.6) is not None


def test_thresholds_are_float32_and_the_verdict_is_the_float32_comparison():
    """The device compares the float32 loss and grad norm with torch.tensor(thresholds()); the host's judge must give
    the same verdict for every float32 value, also one ulp either side of a threshold."""
    m = monitor(LOSSES, [g * 1.000123 for g in GRADS])
    state = m.state_dict()
    limits = m.thresholds()
    assert all(np.float32(t) == t for t in limits)
    device_limits = torch.tensor(limits)
    assert device_limits.dtype == torch.float32 and device_limits.tolist() == list(limits)
    grad_ok = float(np.median(GRADS))
    loss_ok = float(np.median(LOSSES))
    for which in (0, 1):
        t = np.float32(limits[which])
        candidates = [t, np.nextafter(t, np.float32(np.inf)), np.nextafter(t, np.float32(0)), t * np.float32(1.01)]
        for value in candidates:
            value = float(value)
            m.load_state_dict(state)  # each candidate judged by the same window
            loss, grad = (value, grad_ok) if which == 0 else (loss_ok, value)
            host = m.judge(99, loss, grad) is not None
            totals = torch.tensor([loss, grad], dtype=torch.float32)
            device = bool((totals[0] > device_limits[0]) | (totals[1] > device_limits[1]))
            assert host == device == (np.float32(value) > t), (which, value, limits)
    # a float64 value just above a threshold that rounds to it in float32: not a spike on either side
    m.load_state_dict(state)
    between = float(limits[0]) + float(np.spacing(np.float32(limits[0]))) / 4
    assert between > limits[0] and np.float32(between) == np.float32(limits[0])
    assert m.judge(99, between, grad_ok) is None


def test_the_state_round_trip_gives_the_same_thresholds():
    m = monitor()
    m.judge(8, 50.0, 1.0)  # a spike: not in the window, not in the state
    saved = json.loads(json.dumps(m.state_dict()))  # a DCP Stateful of plain strings
    assert set(saved) == {"window"} and isinstance(saved["window"], str)
    fresh = SpikeMonitor(Spikes(window=10, warmup=5))
    fresh.load_state_dict(saved)
    assert fresh.thresholds() == m.thresholds() and list(fresh.losses) == list(m.losses)
    assert (fresh.judge(9, 5.3, 1.4) is None) == (m.judge(9, 5.3, 1.4) is None)
    assert fresh.thresholds() == m.thresholds()
    again = SpikeMonitor(Spikes(window=10, warmup=5))
    again.load_state_dict(fresh.state_dict())
    assert again.thresholds() == fresh.thresholds()


# ---------------------------------------------------------------------------------------------
# The policies in a run: a spike injected at step 6 (the loss, and so the gradients, x 50), judged from step 4


SPIKE = ["--spikes.warmup", "3", "--debug.spike_at_step", "6"]


def metrics_rows(folder) -> dict[int, dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def test_policy_log_says_so_and_the_run_goes_on(tmp_path, capsys):
    status = main([*LOCAL, *SPIKE, "--training.steps", "7", "--job.dump_folder", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0 and (tmp_path / "DONE").exists()
    assert "step 6 spiked: loss" in out and "skipping" not in out
    rows = metrics_rows(tmp_path)
    assert list(rows) == list(range(1, 8))
    assert rows[6]["spike_loss_z"] > 6 and rows[6]["spike_grad_z"] > 10
    assert all("spike_loss_z" not in rows[s] for s in rows if s != 6)
    assert rows[6]["loss"] > 10 * rows[5]["loss"]  # the injected spike (x 50)
    assert (tmp_path / "bad_batches" / "step-000006" / "summary.json").is_file()


@pytest.mark.slow
def test_policy_skip_on_two_ranks_leaves_the_weights_of_the_step_before(tmp_path):
    """policy skip under FSDP on 2 gloo ranks, decided on the device: the weights exported after the spiking step 6
    are those after step 5, bit for bit. Step 6 runs in a resume of the 5-step run: its spike is judged by the
    window the checkpoint restored (warmup 3, so an empty one would judge nothing and the weights would move)."""
    from safetensors.torch import load_file

    common = [*TINY, *SPIKE, "--spikes.policy", "skip", "--job.dump_folder", str(tmp_path / "run")]
    common += ["--checkpoint.enable", "true", "--checkpoint.export_safetensors", "true"]
    common += ["--lr_scheduler.decay_start", "1.0"]  # the lr of steps 1-5 must not depend on the run's length
    ok(run_trainer(2, *common, "--training.steps", "5"))
    shutil.copy(tmp_path / "run" / "model.safetensors", tmp_path / "step-5.safetensors")
    skipped = ok(run_trainer(2, *common, "--training.steps", "6"))
    assert "resumed from" in skipped.stdout and "at step 5" in skipped.stdout
    assert "step 6 spiked" in skipped.stdout and "skipping this update" in skipped.stdout
    assert "spike_loss_z" in metrics_rows(tmp_path / "run")[6]
    before = load_file(tmp_path / "step-5.safetensors")
    after = load_file(tmp_path / "run" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_policy_stop_exits_3_naming_the_data_to_skip_with_the_last_checkpoint_intact(tmp_path, capsys):
    common = [*LOCAL, *SPIKE, "--spikes.policy", "stop", "--training.steps", "8", "--job.dump_folder", str(tmp_path)]
    status = main([*common, "--checkpoint.enable", "true", "--checkpoint.interval", "5"])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert status == 3
    assert len(err) == 1 and err[0].startswith("error: step 6 spiked:"), err
    assert "data.skip = [[6, 6]]" in err[0] and "the last checkpoint (step 5) is intact" in err[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-5"]
    assert (tmp_path / "checkpoints" / "step-5" / "COMPLETE").exists() and not (tmp_path / "DONE").exists()
    assert list(metrics_rows(tmp_path)) == [1, 2, 3, 4, 5]  # the spiking step is not kept
    # The rollback it names (the fault is injected by step number: off now, as bad data would be left out)
    assert main([*common, "--debug.spike_at_step", "0", "--data.skip", "[[6, 6]]"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 5" in out and "step 6: leaving out the data of stream steps 6..6" in out
    assert list(metrics_rows(tmp_path)) == list(range(1, 9)) and (tmp_path / "DONE").exists()


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc
