"""Where a profiled step left the GPU idle, what the host was doing when it resumed, and what launched
the device's work.

A step is host-bound where the GPU finishes its queue and waits for the next launch. In a
torch.profiler Chrome trace each kernel is linked (its `correlation` id) to the runtime call that
launched it, so the launch of the kernel that ends an idle gap says what the host was busy with:
the outermost annotation (`Optimizer.step#Muon.step`, `FSDP::pre_backward (blocks.3)`) and the
outermost operator (`aten::_fused_adamw_`) around it. The same link sums the device's time by what
launched it (`launcher_report`): a compiled graph, an FSDP hook, an optimizer step, or an eager
operator outside all of them. The trainer writes both reports beside each trace ([profiling]); for a
trace on its own:

    python -m atma_titan.profiling <dump_folder>/profile/rank0_step8.json.gz
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("user_annotation", "cpu_op")
TOP = 20


@dataclass(frozen=True)
class Span:
    name: str
    category: str
    start: float  # microseconds, the trace's clock
    duration: float
    correlation: int | None = None

    @property
    def end(self) -> float:
        return self.start + self.duration


def read_spans(path: str | Path) -> list[Span]:
    """The complete ('X') events of a Chrome trace, plain or gzipped."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [
        Span(e["name"], e.get("cat", ""), float(e["ts"]), float(e["dur"]), (e.get("args") or {}).get("correlation"))
        for e in events
        if e.get("ph") == "X" and "dur" in e and "ts" in e
    ]


class HostContext:
    """What the host was inside at a given time: the outermost annotation and the outermost operator."""

    def __init__(self, spans: list[Span]):
        # ProfilerStep spans cover everything: they say nothing about the cause
        self.spans = sorted(
            (s for s in spans if s.category in HOST_CATEGORIES and not s.name.startswith("ProfilerStep")),
            key=lambda s: s.start,
        )
        self.starts = [s.start for s in self.spans]
        self.longest = max((s.duration for s in self.spans), default=0.0)

    def around(self, t: float) -> tuple[str, str]:
        """(outermost annotation, outermost operator) open at time t, '-' for none."""
        first = bisect.bisect_left(self.starts, t - self.longest)  # nothing earlier can still be open at t
        annotation = operator = None
        for s in self.spans[first : bisect.bisect_right(self.starts, t)]:
            if s.end < t:
                continue
            if s.category == "user_annotation" and (annotation is None or s.duration > annotation.duration):
                annotation = s
            if s.category == "cpu_op" and (operator is None or s.duration > operator.duration):
                operator = s
        return (annotation.name if annotation else "-", operator.name if operator else "-")

    def at(self, t: float) -> str:
        return " / ".join(self.around(t))


def idle_report(spans: list[Span], top: int = TOP) -> str:
    """GPU busy and idle time over the trace, the idle time by host context, and the largest gaps."""
    device = sorted((s for s in spans if s.category in DEVICE_CATEGORIES), key=lambda s: s.start)
    if not device:
        return "no GPU activity in this trace\n"
    launches = {s.correlation: s for s in spans if s.category in LAUNCH_CATEGORIES and s.correlation is not None}
    host = HostContext(spans)
    steps = [s.duration / 1e3 for s in spans if s.name.startswith("ProfilerStep") and s.category == "user_annotation"]
    busy, frontier, gaps = 0.0, device[0].start, []
    for s in device:  # the union of the device spans, streams overlapping
        if s.start > frontier:
            launch = launches.get(s.correlation)
            gaps.append((s.start - frontier, s.name, host.at(launch.start) if launch else "(launch not in the trace)"))
        busy += max(0.0, s.end - max(frontier, s.start))
        frontier = max(frontier, s.end)
    span = frontier - device[0].start
    lines = [
        f"profiled steps (host): {', '.join(f'{t:.1f}' for t in steps)} ms",
        f"GPU: {span / 1e3:.1f} ms from first to last kernel, busy {busy / 1e3:.1f} ms, "
        f"idle {(span - busy) / 1e3:.1f} ms ({100 * (span - busy) / span:.0f}%)",
        "",
        f"idle time by what the host was launching when the GPU resumed (annotation / operator), top {top}:",
    ]
    by_context = collections.Counter()
    for gap, _, context in gaps:
        by_context[context] += gap
    lines += [f"  {t / 1e3:8.2f} ms  {context}" for context, t in by_context.most_common(top)]
    lines += ["", f"largest gaps, top {top}:"]
    for gap, kernel, context in sorted(gaps, key=lambda g: -g[0])[:top]:
        lines.append(f"  {gap / 1e3:8.2f} ms  before {kernel[:60]}  <- {context}")
    return "\n".join(lines) + "\n"


def launcher_report(spans: list[Span], top: int = TOP) -> str:
    """Device time summed by what launched it: the outermost annotation around the launch (a compiled graph,
    an FSDP hook, an optimizer step; block indices merged, `FSDP::post_backward_accumulate (blocks.*)`), or
    where there is none the outermost operator (`- / aten::mul`: eager work outside them all); then the
    kernels that took the most time, summed by name under each launcher."""
    device = [s for s in spans if s.category in DEVICE_CATEGORIES]
    if not device:
        return "no GPU activity in this trace\n"
    launches = {s.correlation: s for s in spans if s.category in LAUNCH_CATEGORIES and s.correlation is not None}
    host = HostContext(spans)
    by_launcher, by_kernel, count = collections.Counter(), collections.Counter(), collections.Counter()
    for s in device:
        launch = launches.get(s.correlation)
        annotation, operator = host.around(launch.start) if launch else ("(launch not in the trace)", "-")
        launcher = re.sub(r"\.\d+\b", ".*", annotation) if annotation != "-" else f"- / {operator}"
        by_launcher[launcher] += s.duration
        by_kernel[(s.name, launcher)] += s.duration
        count[launcher] += 1
        count[(s.name, launcher)] += 1
    total = sum(by_launcher.values())
    lines = [f"device time by what launched it (outermost annotation, else operator), {total / 1e3:.2f} ms in all:"]
    for launcher, t in by_launcher.most_common(top):
        lines.append(f"  {t / 1e3:8.2f} ms {100 * t / total:4.0f}% {count[launcher]:6d} kernels  {launcher[:90]}")
    lines += ["", f"kernels by name and launcher, top {top}:"]
    for (kernel, launcher), t in by_kernel.most_common(top):
        lines.append(f"  {t / 1e3:8.2f} ms {count[(kernel, launcher)]:6d}x  {kernel[:60]}  <- {launcher[:60]}")
    return "\n".join(lines) + "\n"
