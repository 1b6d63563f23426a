"""python -m atma_titan.profiling TRACE: where a profiled step left the GPU idle, and what launched its work."""

from __future__ import annotations

import sys
from pathlib import Path

from atma_titan.profiling.trace_gaps import idle_report, launcher_report, read_spans
from atma_titan.utils.cli import command, command_parser
from atma_titan.utils.errors import InputError


@command
def main(argv: list[str] | None = None) -> int:
    parser = command_parser("profiling", "Where a profiled step left the GPU idle, and what launched its work.")
    parser.add_argument("trace", metavar="TRACE.json[.gz]", help="a torch.profiler Chrome trace, plain or gzipped")
    args = parser.parse_args(argv)
    if not Path(args.trace).is_file():
        parser.error(f"{args.trace}: no such file")
    try:
        spans = read_spans(args.trace)
    except (OSError, ValueError, KeyError) as e:  # not gzip, not JSON, or JSON without traceEvents
        raise InputError(f"{args.trace}: not a readable Chrome trace ({type(e).__name__}: {e})") from None
    print(idle_report(spans), launcher_report(spans), sep="\n", end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
