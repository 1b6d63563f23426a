"""The debug checkpoint the eval command's tests run on (one per test module)."""

import pytest
from helpers import EVAL_TRAIN

from atma_titan.config import load_config
from distributed_utils import ROOT


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step debug run (helpers.EVAL_TRAIN): checkpoints at steps 1 and 2 and model.safetensors."""
    from atma_titan.train import train

    dump = tmp_path_factory.mktemp("run")
    train(load_config(["--config", str(ROOT / "train_configs/debug_model.toml"), "--job.dump_folder", str(dump),
                       *EVAL_TRAIN]))  # fmt: skip
    return dump
