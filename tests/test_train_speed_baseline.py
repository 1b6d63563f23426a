"""benchmarks/train_speed.py --baseline softmax: a same-size softmax transformer through the same trainer."""

import importlib.util

import torch

from atma_titan.config import load_config
from atma_titan.models.atma import ATMA
from atma_titan.models.flavors import resolve_model_args
from distributed_utils import ROOT


def train_speed():
    spec = importlib.util.spec_from_file_location("train_speed", ROOT / "benchmarks" / "train_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_softmax_baseline_is_a_plain_transformer_of_the_same_size():
    bench = train_speed()
    config = ["--config", str(ROOT / "train_configs" / "atma_370m.toml")]
    atma = resolve_model_args(load_config(config).model)
    baseline = resolve_model_args(load_config(config + bench.BASELINES["softmax"]).model)
    assert baseline.global_layers == tuple(range(atma.n_layers))
    assert (baseline.attention, baseline.memory, baseline.canon, baseline.position) == ("softmax", False, False, "rope")
    widths = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "mlp", "vocab_size")
    assert all(getattr(baseline, k) == getattr(atma, k) for k in widths)
    with torch.device("meta"):
        sizes = [sum(p.numel() for p in ATMA(a).parameters()) for a in (atma, baseline)]
    assert 0.9 < sizes[1] / sizes[0] < 1.1, sizes


def test_the_l4_and_one_micro_batch_switches_match_the_configs_they_stand_for():
    bench = train_speed()
    recipe = load_config(["--config", str(ROOT / "train_configs" / "atma_370m.toml")])
    l4 = load_config(["--config", str(ROOT / "train_configs" / "atma_370m_l4.toml")])
    switched = load_config(["--config", str(ROOT / "train_configs" / "atma_370m.toml"), *bench.variant_args("l4")])
    assert switched.training.micro_batch_size == l4.training.micro_batch_size
    assert switched.debug.memory_cap_gib == 22  # an L4's 24 GB less what CUDA and the driver keep
    one = load_config(["--config", str(ROOT / "train_configs" / "atma_370m.toml"), *bench.variant_args("step32k")])
    assert one.training.batch_tokens == recipe.training.micro_batch_size * recipe.training.seq_len


def test_the_reshard_switch_turns_on_what_one_rank_leaves_off():
    bench = train_speed()
    recipe = ["--config", str(ROOT / "train_configs" / "atma_370m.toml")]
    assert load_config(recipe).parallelism.reshard_after_forward is None  # one rank: no re-gather in backward
    assert load_config(recipe + bench.variant_args("reshard")).parallelism.reshard_after_forward is True
