"""`python -m atma_titan.sweep ...` (and what launch/sweep_array.sbatch runs: `... run --cell N`)."""

import sys

from atma_titan.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
