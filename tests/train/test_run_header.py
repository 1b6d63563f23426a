"""What the start of a run says beyond the model and the batch: the CPU threads it took, a loss that is not
plain CE, and a config that is valid but probably not meant (on stderr)."""

import os
import subprocess
import sys

from distributed_utils import TINY, run_trainer
from helpers import SMALL

from atma_titan.config import load_config
from atma_titan.config.validation import config_warnings
from atma_titan.utils.device import usable_cores


def test_the_header_names_the_threads_the_weighted_loss_and_a_warm_up_longer_than_the_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    args = ["--job.dump_folder", str(tmp_path), "--lr_scheduler.warmup_steps", "100", "--data.recall_weight", "100"]
    proc = subprocess.run(
        [sys.executable, "-m", "atma_titan.train", *SMALL, *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.split("training steps")[0]
    cores = usable_cores()
    assert f"  cpu threads: {cores} per rank ({cores} cores / 1 local rank; OMP_NUM_THREADS unset)\n" in header
    assert "  loss is recall-weighted (data.recall_weight = 100): not comparable to plain CE\n" in header
    # (and a warning about the load average when other jobs run beside this test: its own test)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: 'lr_scheduler")]
    assert warnings == [
        "warning: 'lr_scheduler.warmup_steps' = 100 is longer than the run ('training.steps' = 3): the learning rate "
        "reaches only 3% of its peak; lower the warm-up or raise the steps"
    ]


def test_omp_num_threads_is_what_the_run_takes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "atma_titan.train", *SMALL, "--training.steps", "1", "--job.dump_folder", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "  cpu threads: 1 per rank (OMP_NUM_THREADS=1)\n" in proc.stdout
    assert "recall-weighted" not in proc.stdout and "warning:" not in proc.stderr


def test_a_warm_up_within_the_run_is_no_warning():
    assert config_warnings(load_config(["--training.steps", "20", "--lr_scheduler.warmup_steps", "20"])) == []
    assert len(config_warnings(load_config(["--training.steps", "20", "--lr_scheduler.warmup_steps", "21"]))) == 1


def test_two_ranks_say_their_threads_and_that_tok_s_is_per_rank(tmp_path):
    proc = run_trainer(2, *TINY, "--training.steps", "1", "--job.dump_folder", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "  cpu threads: 1 per rank (OMP_NUM_THREADS=1, torchrun's default for several local ranks)\n" in proc.stdout
    assert "  tok/s and mfu are per rank: the job's tokens/s is 2 x tok/s\n" in proc.stdout
