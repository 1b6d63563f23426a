"""The config reference command: every key of every section, its type, default and meaning.

    python -m atma_titan.config                                print it (markdown)
    python -m atma_titan.config --update [docs/config.md]      rewrite the file's generated section
"""

from __future__ import annotations

import sys

from atma_titan.config import reference_markdown, write_reference
from atma_titan.utils.cli import command, command_parser


@command
def main(argv: list[str] | None = None) -> int:
    p = command_parser("config", "The reference of every config key, as markdown tables.")
    p.add_argument(
        "--update", nargs="?", const="docs/config.md", metavar="FILE",
        help="rewrite the section between FILE's config-reference markers (default: print it; FILE: docs/config.md)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.update:
        write_reference(args.update)
        print(f"wrote the config reference into {args.update}")
    else:
        print(reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
