"""A torch.profiler window over a few training steps ([profiling] in the config).

Each rank writes a Chrome / Perfetto trace (`rank<R>_step<S>.json.gz`, open it in ui.perfetto.dev)
and a table of the operators and kernels that took the most device time (`rank<R>_top.txt`), under
<dump_folder>/<profiling.folder>. On a GPU it also writes where the device sat idle waiting for the
host, and what the host was doing then (`rank<R>_gaps.txt`), and the device's time summed by what
launched it: each compiled graph, FSDP hook, optimizer step or eager operator (`rank<R>_launchers.txt`;
both from atma_titan.profiling.trace_gaps). Steps are
counted as the trainer counts them, so a resumed run records the same steps as a fresh one (or none,
if it starts past the window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from atma_titan.profiling.trace_gaps import idle_report, launcher_report, read_spans

TOP_ROWS = 40


class StepProfiler:
    """`with StepProfiler(...) as p:` around the loop, `p.step()` after every optimizer step.

    Inactive (a no-op) unless enabled and the window [start_step, start_step + steps) is still ahead."""

    def __init__(self, cfg, dump: Path, rank: int, first_step: int, device: torch.device, say: Callable = print):
        self.folder = dump / cfg.folder
        self.rank = rank
        self.say = say
        self.cuda = device.type == "cuda"
        last = cfg.start_step + cfg.steps - 1
        self.enabled = cfg.enable and first_step <= last
        if cfg.enable and not self.enabled:
            say(f"profiling: the window (steps {cfg.start_step}..{last}) is behind step {first_step}; not recording")
        self.last_step = last
        self._prof = None
        if self.enabled:  # the schedule counts p.step() calls from first_step; a warm-up step first when there is room
            ahead = max(0, cfg.start_step - first_step)
            warmup = 1 if ahead else 0
            active = min(cfg.steps, last - first_step + 1)
            self.window = schedule(skip_first=ahead - warmup, wait=0, warmup=warmup, active=active, repeat=1)

    def __enter__(self) -> "StepProfiler":
        if self.enabled:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._prof = profile(
                activities=activities, schedule=self.window, on_trace_ready=self._write, record_shapes=True
            )
            self._prof.__enter__()
        return self

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)
            self._prof = None

    def _write(self, prof) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}_step{self.last_step}.json.gz"
        prof.export_chrome_trace(str(trace))
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=TOP_ROWS)
        (self.folder / f"rank{self.rank}_top.txt").write_text(table + "\n")
        if self.cuda:
            spans = read_spans(trace)
            (self.folder / f"rank{self.rank}_gaps.txt").write_text(idle_report(spans))
            (self.folder / f"rank{self.rank}_launchers.txt").write_text(launcher_report(spans))
        if self.rank == 0:
            also = ", rank0_gaps.txt and rank0_launchers.txt" if self.cuda else ""
            self.say(f"profiling: wrote {trace}, {self.folder / 'rank0_top.txt'}{also}")
