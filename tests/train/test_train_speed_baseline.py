"""benchmarks/train/train_speed.py --baseline softmax: a same-size softmax transformer through the same trainer."""

import importlib.util
import json
import statistics
from pathlib import Path

import torch

from atma_titan.config import load_config
from atma_titan.models.atma import ATMA
from atma_titan.models.flavors import resolve_model_args
from distributed_utils import ROOT


def train_speed():
    spec = importlib.util.spec_from_file_location("train_speed", ROOT / "benchmarks" / "train" / "train_speed.py")
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


def test_the_recipes_train_compiled_and_the_eager_switch_turns_it_off():
    """The speed table's recipe rows are compiled: so are the configs a user runs, and `eager` really is."""
    bench = train_speed()
    for name in ("atma_370m.toml", "atma_370m_l4.toml"):
        config = ["--config", str(ROOT / "train_configs" / name)]
        assert load_config(config).training.compile
        assert not load_config(config + bench.variant_args("eager")).training.compile
        assert load_config(config + bench.variant_args("compile")).training.compile


def test_the_reshard_switch_turns_on_what_one_rank_leaves_off():
    bench = train_speed()
    recipe = ["--config", str(ROOT / "train_configs" / "atma_370m.toml")]
    assert load_config(recipe).parallelism.reshard_after_forward is None  # one rank: no re-gather in backward
    assert load_config(recipe + bench.variant_args("reshard")).parallelism.reshard_after_forward is True


def test_the_adamw_switch_trains_every_parameter_with_adamw_as_the_issues_softmax_baseline_did():
    from atma_titan.models import build_model
    from atma_titan.optim import build_optimizers

    bench = train_speed()
    cfg = load_config(["--config", str(ROOT / "train_configs" / "debug_model.toml"), *bench.variant_args("adamw")])
    assert cfg.optimizer.name == "adamw"
    model = build_model(resolve_model_args(cfg.model), torch.device("cpu"), seed=0)
    (adam,) = build_optimizers(model, cfg.optimizer).optimizers
    assert isinstance(adam, torch.optim.AdamW)
    assert sum(len(g["params"]) for g in adam.param_groups) == len(list(model.parameters()))


def test_a_smaller_batch_runs_more_steps_over_the_same_tokens(tmp_path, monkeypatch):
    """step32k (one micro-batch of the recipe's 16) runs 16 times the steps and leaves 16 times the warm-up
    out of its median; the other switches keep the config's batch and the steps asked for."""
    import subprocess
    import types

    bench = train_speed()
    config = str(ROOT / "train_configs" / "atma_370m.toml")
    assert bench.steps_per_config_step("compile+selective+step32k", config, []) == 16
    assert bench.steps_per_config_step("compile+selective+l4", config, []) == 1
    assert bench.steps_per_config_step("compile+step32k", config, ["--training.batch_tokens", "65536"]) == 2

    def fake_run(cmd, **kwargs):  # the trainer's metrics.jsonl: steps 1..N, step k at k tokens/s
        steps = int(cmd[cmd.index("--training.steps") + 1])
        folder = Path(cmd[cmd.index("--job.dump_folder") + 1])
        folder.mkdir(parents=True)
        rows = [
            {"step": k, "tokens_per_second": k, "mfu": None, "memory_gib": 1.0, "loss": 1.0}
            for k in range(1, steps + 1)
        ]
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = types.SimpleNamespace(config=config, steps=10, warmup=3, nproc=1, timeout=60, logs=str(tmp_path))
    one = bench.run_variant("compile+selective+step32k", args, [], tmp_path / "a")
    assert (one["steps"], one["timed_steps"], one["tokens_per_second"]) == (160, 112, statistics.median(range(49, 161)))
    recipe = bench.run_variant("compile+selective", args, [], tmp_path / "b")
    assert (recipe["steps"], recipe["timed_steps"], recipe["tokens_per_second"]) == (10, 7, 7)
