"""The comparison command: several evaluations side by side (atma_titan.eval.compare); needs no torch.

    python -m atma_titan.compare outputs/a/eval/results.json outputs/b/eval [--names A,B] --out DIR
"""

from __future__ import annotations

import sys

from atma_titan.eval.compare import load_results, write_comparison
from atma_titan.utils.cli import command, command_parser


@command
def main(argv: list[str] | None = None) -> int:
    p = command_parser("compare", "Several evaluations side by side: one table and one figure of every model.")
    p.add_argument("results", nargs="+", help="results.json files, or the eval folders holding them")
    p.add_argument("--names", help="comma-separated labels, one per results file (default: each file's name)")
    p.add_argument("--out", required=True, help="folder for results.md, needle.png and length_curve.png")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.names.split(",")] if args.names else None
    for path in write_comparison(load_results(args.results, names), args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
