"""Profiling a training run: the torch.profiler window over chosen steps (window) and the reading of its
traces (trace_gaps: idle gaps and what launched the device's work; `python -m atma_titan.profiling`)."""
