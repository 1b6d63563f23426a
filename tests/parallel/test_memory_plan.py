"""The dry run's memory plan (atma_titan/parallel/memory_plan.py): exact training state, the activation model
against measured peaks, and what the dry run prints."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from atma_titan.config import load_config
from atma_titan.models import ATMA
from atma_titan.models.builder import build_model
from atma_titan.models.flavors import FLAVORS
from atma_titan.optim import build_optimizers
from atma_titan.optim.muon import Muon
from atma_titan.parallel import memory_plan as mp
from atma_titan.run.resume_check import may_change
from atma_titan.train import main
from distributed_utils import ROOT, run_gloo_script

GiB = 1 << 30


def meta_model(flavor: str) -> ATMA:
    with torch.device("meta"):
        return ATMA(FLAVORS[flavor])


def step(mb=16, accum=16, ac=mp.Checkpointing("selective", blocks="global"), shards=1, **kw) -> mp.Step:
    return mp.Step(mb, 2048, accum, shards, 1, shards > 1, ac, **kw)


def state_tensor_bytes(optimizers) -> int:
    """The bytes of every state tensor the optimizers hold (a DTensor's local shard)."""
    total = 0
    for opt in optimizers.optimizers:
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    total += local.numel() * local.element_size()
    return total


# ---------------------------------------------------------------------------------------------
# The exact part


@pytest.mark.parametrize("flavor", ["debug", "atma_370m"])
@pytest.mark.parametrize("optimizer", ["muon_adamw", "adamw"])
def test_state_bytes_are_exact_on_one_rank(flavor, optimizer):
    """Counted here from the parameters and the real optimizers' parameter groups (built on the meta device)."""
    model = meta_model(flavor)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    cfg = load_config(["--optimizer.name", optimizer])
    groups = {
        type(o): [p for g in o.param_groups for p in g["params"]]
        for o in build_optimizers(model, cfg.optimizer).optimizers
    }
    muon = 4 * sum(p.numel() for p in groups.get(Muon, []))
    adamw = sum(8 * p.numel() + 4 for p in groups[torch.optim.AdamW])  # exp_avg, exp_avg_sq, an fp32 step
    assert muon + adamw > 0 and len(groups.get(Muon, [])) + len(groups[torch.optim.AdamW]) == len(params)

    accumulating = mp.state_bytes(model, optimizer, step(accum=16))
    assert (accumulating.params, accumulating.gathered) == (4 * n, 2 * n)
    assert (accumulating.grads_accumulated, accumulating.grads_sharded) == (4 * n, 4 * n)
    assert (accumulating.muon, accumulating.adamw) == (muon, adamw)
    one = mp.state_bytes(model, optimizer, step(accum=1))
    assert one.grads_accumulated == 0 and one.grads_sharded == 4 * n  # no whole gradients held at the peak
    if flavor == "atma_370m":
        assert n == 378_220_864 and accumulating.params == 1_512_883_456


def test_optimizer_state_equals_the_real_optimizers_state_after_a_step():
    """The debug model on the CPU, the recipe's optimizers, one step: the plan's parameter, gradient and optimizer
    bytes are what the tensors hold."""
    args = dataclasses.replace(FLAVORS["debug"], attention_impl="reference", memory_impl="reference")
    for name in ("muon_adamw", "adamw"):
        model = build_model(args, torch.device("cpu"), seed=0)
        optimizers = build_optimizers(model, load_config(["--optimizer.name", name]).optimizer)
        tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
        model(tokens).logsumexp(-1).mean().backward()
        optimizers.step()
        plan = mp.state_bytes(model, name, step(accum=1, compute_bytes=4))
        assert plan.optimizer == state_tensor_bytes(optimizers), name
        assert plan.params == sum(p.numel() * p.element_size() for p in model.parameters())
        assert plan.grads_sharded == sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())


SHARDED_SCRIPT = """
import dataclasses, torch
from atma_titan.config import load_config
from atma_titan.models.builder import build_model
from atma_titan.models.flavors import FLAVORS
from atma_titan.optim import build_optimizers
from atma_titan.parallel import LaunchEnv, init_distributed, parallelize

dims = init_distributed(LaunchEnv.from_environ(), 1, -1, "cpu")
args = dataclasses.replace(FLAVORS["debug"], attention_impl="reference", memory_impl="reference")
model = build_model(args, torch.device("cpu"), parallel=lambda m: parallelize(m, dims), seed=0)
optimizers = build_optimizers(model, load_config([]).optimizer)
tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
model(tokens).logsumexp(-1).mean().backward()
optimizers.step()

def local_bytes(tensors):
    return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for t in tensors)

state = [v for opt in optimizers.optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
result = {"params": local_bytes(model.parameters()), "grads": local_bytes(p.grad for p in model.parameters()),
          "optimizer": local_bytes(state)}
"""


@pytest.mark.slow
def test_sharded_state_bytes_are_rank_zeros_fsdp2_shards(tmp_path):
    """Three gloo ranks (uneven shards: the debug model's 2-row Polar scalars, 3 x 128-row matrices): rank 0 holds
    the largest shard of every parameter, which is what the plan counts."""
    result = run_gloo_script(SHARDED_SCRIPT, 3, tmp_path)
    plan = mp.state_bytes(meta_model("debug"), "muon_adamw", step(accum=1, shards=3, compute_bytes=4))
    assert result == {"params": plan.params, "grads": plan.grads_sharded, "optimizer": plan.optimizer}


def test_resharding_after_forward_gathers_a_few_blocks_at_the_peak():
    """dp_shard 8 reshards after forward (parallelize.resolve_reshard_after_forward): at the activation peak the
    head and two blocks are gathered; only between micro-batches, after a backward that kept its blocks
    (set_micro_batch), is the whole bf16 copy held, with the whole accumulated gradients."""
    model = meta_model("atma_370m")
    n = sum(p.numel() for p in model.parameters())
    sharded = mp.plan_memory(model, "muon_adamw", step(16, 2, shards=8))
    head = sum(p.numel() for p in (*model.norm.parameters(), *model.head.parameters()))
    assert sharded.states.gathered == 2 * (head + 2 * sum(p.numel() for p in model.blocks["2"].parameters()))
    assert sharded.states.gathered_whole == 2 * n  # 8 divides every dim 0 of the 370M: no padding
    assert (
        sharded.between_micro_batches
        == sharded.states.params + 2 * n + 4 * n + sharded.states.optimizer + sharded.workspace
    )
    whole = mp.plan_memory(model, "muon_adamw", dataclasses.replace(step(16, 2, shards=8), reshard_after_forward=False))
    assert whole.states.gathered == 2 * n
    assert whole.allocated - sharded.allocated == whole.states.gathered - sharded.states.gathered


def test_a_shard_is_fsdp2s_first_chunk():
    """FSDP2 cuts dim 0 as torch.chunk does (and pads every rank to the first chunk)."""
    for shape in [(50_304, 1024), (8, 128), (2,), (1024, 3), (5, 7)]:
        for shards in (1, 2, 3, 8, 64):
            first = torch.chunk(torch.empty(shape, device="meta"), shards)[0]
            assert mp.shard_numel(torch.empty(shape, device="meta"), shards) == first.numel(), (shape, shards)


# ---------------------------------------------------------------------------------------------
# The activations against measurements

# Peak memory (torch.cuda.max_memory_allocated) of the 370M model at 2,048 tokens on one H200, one rank, compiled,
# the recipe's 524,288 tokens a step: docs/performance.md's training tables of 2026-12-04 ("Throughput against a
# same-size softmax transformer" and "The L4 budget, on an H200", the `peak memory` column), and the runs of
# benchmarks/train/memory_peaks.py on 2026-12-05 (docs/performance.md, "Peak memory against the dry run's plan").
# (micro-batch, AC mode, AC blocks, micro-batches a step) -> GiB. These are measurements, not the code's results.
MEASURED_PEAKS = {
    (16, "selective", "global", 16): 23.8,  # the recipe
    (16, "selective", "all", 16): 22.3,  # acall
    (16, "none", "all", 16): 26.1,  # noac
    (16, "selective", "global", 1): 22.4,  # step32k
    (8, "selective", "global", 32): 15.2,  # atma_370m_l4.toml
    (8, "full", "global", 32): 12.4,
    (32, "selective", "global", 8): 41.68,
    (32, "none", "all", 8): 46.25,
    (16, "full", "all", 16): 10.00,
    (4, "selective", "all", 64): 10.29,
}


@pytest.mark.parametrize("point", list(MEASURED_PEAKS))
def test_the_estimate_is_within_10_percent_of_each_measured_peak(point):
    mb, mode, blocks, accum = point
    plan = mp.plan_memory(meta_model("atma_370m"), "muon_adamw", step(mb, accum, mp.Checkpointing(mode, blocks=blocks)))
    measured = MEASURED_PEAKS[point] * GiB
    assert abs(plan.allocated / measured - 1) < 0.10, (plan.allocated / GiB, MEASURED_PEAKS[point])


# One compiled 370M block on the H200 at 16 x 2,048 tokens (benchmarks/train/memory_peaks.py, blocks), bytes per
# token kept for backward beside its input and output: measurements.
MEASURED_BLOCKS = {
    ("local", "none"): 28_680.0,
    ("local", "selective"): 24_576.0,
    ("local", "full"): 2_048.0,
    ("global", "none"): 64_165.5,
    ("global", "selective"): 45_328.0,
    ("global", "full"): 0.0,
}


@pytest.mark.parametrize("kind, mode", list(MEASURED_BLOCKS))
def test_each_block_keeps_what_was_measured(kind, mode):
    args = FLAVORS["atma_370m"]
    block = mp.block_memory(args, kind == "global", mode, "matmuls", 2048)
    kept = block.saved - 2 * args.d_model  # the measurement leaves the block's input out
    assert kept == pytest.approx(MEASURED_BLOCKS[kind, mode], abs=0.015 * 64_165.5)


def test_the_heads_loss_keeps_and_runs_what_was_measured():
    """The fused loss at 32K tokens, 1,024 MiB chunks, on the H200: 170,232,320 bytes kept, 1,199,184,896 alive above
    them at its peak (benchmarks/train/memory_peaks.py, head)."""
    args = FLAVORS["atma_370m"]
    per_token, fixed, running = mp.head_memory(args, step(16))
    grad_hidden = 2 * args.d_model  # per token; the final norm's input is kept by the norm, not measured here
    assert grad_hidden * 32_768 + fixed == pytest.approx(170_232_320, rel=1e-5)
    assert running == pytest.approx(1_199_184_896, rel=0.005)
    assert per_token > grad_hidden


def test_the_gated_delta_workspaces_are_the_kernels():
    triton_chunked = pytest.importorskip("atma_titan.kernels.gated_delta.triton_chunked")
    args = FLAVORS["atma_370m"]
    assert mp.GATED_DELTA_CHUNK == triton_chunked.CHUNK
    for seq_len in (2048, 1000):
        shapes = triton_chunked.workspace_shapes(1, seq_len, args.n_heads, args.head_dim, args.head_dim)
        nbytes = sum(torch.Size(s).numel() * (4 if name == "g" else 2) for name, s in shapes.items())
        assert mp.gated_delta_workspace_bytes(args, seq_len, 2) * seq_len == pytest.approx(nbytes)


def test_less_checkpointing_never_takes_less_memory():
    model = meta_model("atma_370m")
    for mb in (1, 4, 16):
        peaks = [mp.plan_memory(model, "muon_adamw", step(mb, 256 // mb, ac)).allocated for ac in mp.AC_CHOICES]
        assert peaks == sorted(peaks, reverse=True), mb
        doubled = mp.plan_memory(model, "muon_adamw", step(mb * 2, 128 // mb)).allocated
        assert doubled > peaks[1]


# ---------------------------------------------------------------------------------------------
# What fits, and what the dry run prints


def test_advice_is_the_fastest_setting_that_fits():
    model = meta_model("atma_370m")
    recipe = step()
    l4 = mp.Budget(mp.GPUS["l4"])
    assert not l4.fits(mp.plan_memory(model, "muon_adamw", recipe))
    better = mp.advice(model, "muon_adamw", recipe, l4)
    assert better is not None and l4.fits(better) and better.step.micro_batch < 16
    # Nothing else that fits is estimated faster.
    for mb in mp.micro_batches(recipe):
        for ac in mp.AC_CHOICES:
            other = mp.plan_memory(
                model, "muon_adamw", dataclasses.replace(recipe, micro_batch=mb, accum=256 // mb, ac=ac)
            )
            if l4.fits(other):
                assert mp.relative_time(model, other.step) >= mp.relative_time(model, better.step) - 1e-3
    h200 = mp.Budget(mp.GPUS["h200"])
    assert mp.advice(model, "muon_adamw", recipe, h200).step == recipe  # it fits: no other is faster
    assert mp.micro_batches(recipe) == [16, 8, 4, 2, 1]
    assert mp.micro_batches(dataclasses.replace(recipe, micro_batch=6, accum=2)) == [6, 3]


def test_full_ac_costs_a_forward_of_the_blocks_it_recomputes():
    model = meta_model("atma_370m")
    assert mp.recompute_share(model, step(ac=mp.Checkpointing("selective", blocks="all"))) == 0
    full = mp.recompute_share(model, step(ac=mp.Checkpointing("full", blocks="all")))
    blocks = sum(p.numel() for b in model.blocks.values() for p in b.parameters() if p.dim() >= 2)
    assert full == pytest.approx(blocks / (3 * (blocks + model.head.weight.numel())))
    narrow = mp.recompute_share(model, step(ac=mp.Checkpointing("selective", save="narrow_matmuls", blocks="all")))
    assert 0 < narrow < full


def test_a_budget_nothing_fits_says_so():
    model = meta_model("debug")
    line = mp.verdict(
        model, "muon_adamw", mp.plan_memory(model, "muon_adamw", step(4, 4)), mp.Budget(mp.Gpu("t", "tiny GPU", GiB))
    )
    assert "fits on a tiny GPU: no" in line and "nothing fits" in line


def test_a_memory_cap_is_the_budget():
    plan = mp.plan_memory(meta_model("atma_370m"), "muon_adamw", step(8, 32))
    capped = mp.Budget(mp.GPUS["h200"], cap_gib=22)
    assert capped.need(plan) == plan.allocated + plan.reserve and capped.fits(plan)
    assert not mp.Budget(mp.GPUS["h200"], cap_gib=12).fits(plan)


def test_the_dry_run_prints_the_table_and_the_verdict():
    cmd = [sys.executable, "-m", "atma_titan.train", "--config", "train_configs/debug_model.toml"]
    proc = subprocess.run([*cmd, "--job.dry_run", "true", "--job.gpu", "l4"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "memory per rank: 1 rank (dp_shard 1; no WORLD_SIZE" in out
    for row in ("parameters, fp32 shards", "gradients, fp32", "optimizer state", "activations", "workspaces"):
        assert f"\n  {row} " in out, row
    assert "fits on an L4 (22.5 GiB): yes" in out
    assert "training.compile = false: an eager step keeps more" in out  # the debug config runs eagerly


def test_a_config_that_cannot_fit_prints_the_advice(capsys):
    argv = ["--config", "train_configs/atma_370m.toml", "--job.dry_run", "true", "--job.gpu", "l4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fits on an L4 (22.5 GiB): no (estimated 27." in out
    assert "fastest that fits: micro-batch 8 with" in out
    assert "training.compile = false" not in out
    assert main([*argv, "--job.plan_world_size", "8", "--job.gpu", "all"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank: 8 ranks (dp_shard 8; job.plan_world_size)" in out
    assert out.count("fits on ") == len(mp.GPUS)


def test_torchruns_world_size_is_planned_for(capsys):
    cfg = load_config(["--config", "train_configs/atma_370m.toml", "--job.gpu", "h200"])
    mp.print_memory_plan(cfg, FLAVORS["atma_370m"], world_size=4)
    out = capsys.readouterr().out
    assert "4 ranks (dp_shard 4; torchrun's WORLD_SIZE), micro-batch 16 x 2,048 (4 a step)" in out


def test_the_plans_keys_may_change_on_resume():
    assert may_change("job", "gpu") and may_change("job", "plan_world_size")


def test_the_config_names_exactly_the_gpus_the_plan_knows():
    from atma_titan.config.sections import Job

    choices = next(f.metadata["choices"] for f in dataclasses.fields(Job) if f.name == "gpu")
    assert choices == ("auto", "all", *mp.GPUS)
