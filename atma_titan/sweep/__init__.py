"""Ablation sweeps: a factorial over config keys, each cell a full training run plus evaluation.

    python -m atma_titan.sweep [run] --base train_configs/atma_370m.toml --out sweeps/ablation \\
        --factor model.attention=polar,softmax --factor model.memory=[true,false] \\
        --set training.steps=1900 --eval-args "--gaps 2048,4096,8192 --trials 32 --length-curve"
    python -m atma_titan.sweep ... --seeds 0,1,2                     # every cell once per job.seed
    python -m atma_titan.sweep plan --base ... --factor ... [--seeds 0,1,2]   # estimated GPU-hours, runs nothing
    python -m atma_titan.sweep run --out sweeps/ablation            # resume the saved plan (sweep.json)
    python -m atma_titan.sweep run --out sweeps/ablation --cell 3   # one cell (a SLURM array task runs this)
    python -m atma_titan.sweep list --out sweeps/ablation           # cells: index, status, name, loss
    python -m atma_titan.sweep collect --out sweeps/ablation        # results.md / .csv, needle.png, length_curve.png
    python -m atma_titan.sweep slurm --base ... --factor ... --out sweeps/ablation --max-parallel 4 [--dry-run]

The cells are the Cartesian product of the `--factor section.key=v1,v2,...` values (the first factor
varies slowest), each named from its values (`attention-polar_memory-true`) with its own folder
`<out>/cells/<name>/`: `run/` (the trainer's dump folder, laid out as atma_titan.run.folder says),
`eval/` (the eval command's output), `train.log`, `eval.log`, and `FAILED` after a failure. With
`--seeds 0,1,2` every cell is three runs differing only in `job.seed`, each with its own folder
`<cell>_seed-<S>` (the seed varies fastest; `--cell N` and the SLURM array index the runs), and
`collect` reports each cell's mean and range (min-max, with n) over its seeds. Every
cell's config is checked with the project's own loader before anything runs (a bad key or value:
the loader's message, exit 2).

`<out>/sweep.json` holds the plan (the base file's absolute path and its sha256, factors, `--set`
overrides, eval args, cells, and `workdir`: the absolute directory the plan was made in). A later
command with a different plan into the same folder is refused unless `--force-plan` (the same base
file named from another directory is the same plan); commands given only `--out` use the saved
plan. A combination the config rejects (e.g. the distractor loss with softmax attention) is an
error, or left out with `--skip-invalid`.

Every cell's train and eval commands run in `workdir`, with absolute paths for the cell's folders,
so relative paths inside the base TOML (data files) resolve as they did when the sweep was
planned, and `run` / `list` / `collect --out <sweep folder>` work from any current directory. (A
plan written before `workdir` existed still loads: its base relative to the current directory,
which is also its workdir.)

A cell is done when `run/DONE` and `eval/results.json` exist, and is then skipped; a trained cell
only runs its evaluation; a partly trained one resumes from its checkpoints (checkpointing is
always on in a sweep). A failed cell is recorded in `FAILED` (stage, exit status, log tail), the
sweep goes on with the next cell and exits 1 at the end; a re-run retries it. SIGTERM or Ctrl-C
asks the running trainer to checkpoint and stop (a second one after 2 s aborts it), records no
failure and exits 128 + the signal number. The comparison plots are atma_titan.eval.report's;
without matplotlib `collect` warns and writes the table only. `list` and `collect` on a saved plan
do not import torch.

The sweep's evaluation passes `--trials 256` to the eval command before `--eval-args` (which can
set another). `plan` prints the estimated GPU-hours of training per cell and in total per GPU kind
(atma_titan.sweep.budget: measured H200 tokens/s, scaled by FLOPs per token and peak FLOP/s).

Modules, one per verb: `plan` (factors, cells, seeds, sweep.json), `cells` (a cell's folder and
status), `local` (running cells here: the commands, stages, stop signals), `slurm` (the job array),
`measures` (the numbers of one results.json), `seeds` (mean and spread over a cell's seeds),
`collect` (list, results tables, plots), `budget` (the GPU-hour estimate), `cli` (arguments,
resolving the plan, main).

Exit status: 0 all requested cells finished, 1 some cell failed, 2 a bad plan or option.
"""

from atma_titan.sweep.budget import BUILTIN_THROUGHPUT, ThroughputTable, estimate, parse_throughput
from atma_titan.sweep.cells import CellFolder
from atma_titan.sweep.cli import build_parser, main, parse_args, resolve_plan
from atma_titan.sweep.collect import collect, list_cells, needle_accuracy, plot_comparisons, results_table

# Re-exported for callers; to replace spawn / train_command in a test, patch atma_titan.sweep.local.
from atma_titan.sweep.local import EVAL_TRIALS, eval_command, run_sweep, spawn, train_command
from atma_titan.sweep.plan import (
    PLAN_FILE,
    Cell,
    Factor,
    Plan,
    SweepError,
    build_plan,
    parse_factor,
    parse_plan_options,
    parse_seeds,
    read_plan,
    split_values,
)
from atma_titan.sweep.seeds import Spread, mean_results
from atma_titan.sweep.slurm import SBATCH_SCRIPT, sbatch_command

__all__ = [
    "BUILTIN_THROUGHPUT",
    "EVAL_TRIALS",
    "PLAN_FILE",
    "SBATCH_SCRIPT",
    "Cell",
    "CellFolder",
    "Factor",
    "Plan",
    "Spread",
    "SweepError",
    "ThroughputTable",
    "build_parser",
    "build_plan",
    "collect",
    "estimate",
    "eval_command",
    "list_cells",
    "main",
    "mean_results",
    "needle_accuracy",
    "parse_args",
    "parse_factor",
    "parse_plan_options",
    "parse_seeds",
    "parse_throughput",
    "plot_comparisons",
    "read_plan",
    "resolve_plan",
    "results_table",
    "run_sweep",
    "sbatch_command",
    "spawn",
    "split_values",
    "train_command",
]
