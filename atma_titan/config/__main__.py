"""python -m atma_titan.config [--update docs/config.md]: the reference of every config key."""

import sys

from atma_titan.config import reference_markdown, update_readme

if __name__ == "__main__":
    if sys.argv[1:2] == ["--update"]:
        update_readme(sys.argv[2] if len(sys.argv) > 2 else "README.md")
    else:
        print(reference_markdown())
