"""The [profiling] window: which steps it records, and what it writes."""

from types import SimpleNamespace

import torch

from atma_titan.profiling.window import StepProfiler


def run_steps(tmp_path, first_step, last_step, **cfg):
    section = SimpleNamespace(**{"enable": True, "start_step": 3, "steps": 2, "folder": "profile", **cfg})
    said = []
    profiler = StepProfiler(
        section, tmp_path, rank=0, first_step=first_step, device=torch.device("cpu"), say=said.append
    )
    with profiler:
        for step in range(first_step, last_step + 1):
            with torch.profiler.record_function(f"train_step_{step}"):
                torch.randn(32, 32) @ torch.randn(32, 32)
            profiler.step()
    return tmp_path / section.folder, said


def recorded_steps(folder):
    table = (folder / "rank0_top.txt").read_text()
    return sorted(int(word.rsplit("_", 1)[1]) for word in table.split() if word.startswith("train_step_"))


def test_records_the_window_and_writes_a_trace_and_a_table(tmp_path):
    folder, said = run_steps(tmp_path, first_step=1, last_step=6)
    assert (folder / "rank0_step4.json.gz").stat().st_size > 0
    assert recorded_steps(folder) == [3, 4]
    assert "aten::mm" in (folder / "rank0_top.txt").read_text()
    assert any("rank0_step4.json.gz" in line for line in said)


def test_a_run_resumed_inside_the_window_records_its_rest(tmp_path):
    folder, _ = run_steps(tmp_path, first_step=4, last_step=8, start_step=3, steps=3)
    assert recorded_steps(folder) == [4, 5]


def test_a_run_resumed_past_the_window_records_nothing(tmp_path):
    folder, said = run_steps(tmp_path, first_step=10, last_step=12)
    assert not folder.exists()
    assert any("behind step 10" in line for line in said)


def test_disabled_writes_nothing(tmp_path):
    folder, said = run_steps(tmp_path, first_step=1, last_step=5, enable=False)
    assert not folder.exists() and not said
