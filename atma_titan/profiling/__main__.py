"""python -m atma_titan.profiling TRACE: where a profiled step left the GPU idle, and what launched its work."""

from atma_titan.profiling.trace_gaps import main

if __name__ == "__main__":
    raise SystemExit(main())
