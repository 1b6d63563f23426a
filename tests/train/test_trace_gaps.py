"""atma_titan.profiling.trace_gaps: GPU idle gaps of a profiler trace, blamed on what the host was launching, and the
device's time by what launched it."""

import gzip
import json
import subprocess
import sys

from atma_titan.profiling.trace_gaps import idle_report, launcher_report, read_spans


def span(name, cat, ts, dur, correlation=None):
    event = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def write_trace(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events + [{"ph": "M", "name": "process_name"}]}, f)
    return path


def step_trace(tmp_path):
    """One step: a matmul kernel, 400 us of host work in the optimizer, then its kernel; a 2nd stream overlaps."""
    return write_trace(
        tmp_path / "trace.json.gz",
        [
            span("ProfilerStep#7", "user_annotation", 0, 1000),
            span("Optimizer.step#AdamW.step", "user_annotation", 500, 400),
            span("aten::mm", "cpu_op", 100, 10),
            span("aten::_fused_adamw_", "cpu_op", 550, 300),
            span("aten::add_", "cpu_op", 560, 5),  # nested in the fused op: the outermost operator is named
            span("cudaLaunchKernel", "cuda_runtime", 101, 5, correlation=1),
            span("cudaLaunchKernel", "cuda_runtime", 840, 5, correlation=2),
            span("cudaMemcpyAsync", "cuda_runtime", 102, 5, correlation=3),
            span("mm_kernel", "kernel", 110, 100, correlation=1),
            span("Memcpy HtoD", "gpu_memcpy", 150, 100, correlation=3),  # overlaps the matmul: busy, not a gap
            span("fused_adamw_kernel", "kernel", 850, 50, correlation=2),
        ],
    )


def test_idle_time_is_blamed_on_the_host_work_that_launched_the_next_kernel(tmp_path):
    report = idle_report(read_spans(step_trace(tmp_path)))
    assert "profiled steps (host): 1.0 ms" in report
    # device busy 110..250 and 850..900: 0.19 ms busy, 0.60 ms idle over a 0.79 ms span
    assert "busy 0.2 ms, idle 0.6 ms (76%)" in report
    assert "0.60 ms  Optimizer.step#AdamW.step / aten::_fused_adamw_" in report
    assert "0.60 ms  before fused_adamw_kernel" in report


def test_a_trace_without_gpu_activity_says_so(tmp_path):
    path = write_trace(tmp_path / "cpu.json.gz", [span("aten::mm", "cpu_op", 0, 10)])
    assert idle_report(read_spans(path)) == "no GPU activity in this trace\n"
    assert launcher_report(read_spans(path)) == "no GPU activity in this trace\n"


def test_device_time_is_summed_by_what_launched_it(tmp_path):
    """FSDP's hooks of every block add up under one name; work outside any annotation goes by its operator."""
    events = [span("ProfilerStep#3", "user_annotation", 0, 5000)]
    launchers = [("FSDP::post_backward_accumulate (blocks.0)", 0), ("FSDP::post_backward_accumulate (blocks.13)", 1000)]
    launchers += [("## Call CompiledFxGraph abc ##", 2000)]
    for correlation, (name, start) in enumerate(launchers):
        events += [span(name, "user_annotation", start, 500), span("aten::add_", "cpu_op", start + 10, 100)]
        events += [span("cudaLaunchKernel", "cuda_runtime", start + 20, 5, correlation=correlation)]
        events += [
            span("add_kernel" if correlation < 2 else "mm_kernel", "kernel", start + 30, 300, correlation=correlation)
        ]
    events += [span("aten::mul", "cpu_op", 3000, 100), span("cudaLaunchKernel", "cuda_runtime", 3010, 5, correlation=9)]
    events += [span("mul_kernel", "kernel", 3020, 100, correlation=9), span("lost_kernel", "kernel", 4000, 100)]
    report = launcher_report(read_spans(write_trace(tmp_path / "t.json.gz", events)))
    assert "1.10 ms in all" in report
    assert "0.60 ms   55%      2 kernels  FSDP::post_backward_accumulate (blocks.*)" in report
    assert "0.30 ms   27%      1 kernels  ## Call CompiledFxGraph abc ##" in report
    assert "0.10 ms    9%      1 kernels  - / aten::mul" in report
    assert "1 kernels  (launch not in the trace)" in report
    assert "0.60 ms      2x  add_kernel  <- FSDP::post_backward_accumulate (blocks.*)" in report


def test_the_command_prints_the_report_and_refuses_a_missing_file(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "atma_titan.profiling", str(step_trace(tmp_path))],
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ok.returncode == 0 and "largest gaps" in ok.stdout and "device time by what launched it" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "atma_titan.profiling", str(tmp_path / "none.json")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "usage" in bad.stderr and not bad.stdout
