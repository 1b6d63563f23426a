"""CheckpointManager: exact round trips, the completeness rule, retention, async saves, weight
export, and resharding between 2 FSDP2 ranks (gloo, CPU) and one plain process, both ways."""

import copy
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from atma_titan.checkpoint.manager import CheckpointManager, load_model_only, model_state, optimizer_state
from atma_titan.checkpoint.weights import export_safetensors, load_safetensors
from atma_titan.run.folder import COMPLETE_NAME as MARKER

REPO = Path(__file__).resolve().parents[2]

# DCP's note that it runs in one process without torch.distributed: intended here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ---------------------------------------------------------------------------------------------
# Single process, no torch.distributed
# ---------------------------------------------------------------------------------------------


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class Job:
    """A model, AdamW, a scheduler and a train state: what a trainer checkpoints."""

    def __init__(self, seed: int = 0):
        self.model = tiny_model(seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 0.9**s)
        self.train_state = {"step": 0, "tokens": 0}

    def step(self, seed: int) -> None:
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        self.model(x).square().mean().backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self.train_state["step"] += 1
        self.train_state["tokens"] += 40

    def state(self) -> dict:
        return {
            "model": model_state(self.model),
            "optimizer": optimizer_state(self.model, [self.opt]),
            "lr_scheduler": self.sched,
            "train_state": self.train_state,
        }

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_same_optimizer(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert_same_tensors(a["state"][i], b["state"][i])


def test_round_trip_is_exact_and_resumes_identically(tmp_path):
    job = Job()
    for s in range(3):
        job.step(s)
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(3, job.state())
    saved = (job.params(), copy.deepcopy(job.opt.state_dict()), job.sched.state_dict(), dict(job.train_state))
    job.step(3)
    after_one_more = job.params()

    job.step(4)  # perturb everything, including the train state
    job.train_state.update(step=-1, tokens=-1)
    state = job.state()
    assert ckpt.load(state) is None  # no rank_state was saved
    assert_same_tensors(job.params(), saved[0])
    assert_same_optimizer(job.opt.state_dict(), saved[1])
    assert job.sched.state_dict() == saved[2]
    assert state["train_state"] == saved[3] == {"step": 3, "tokens": 120}

    job.step(3)  # the same step from the restored state gives the same weights, bit for bit
    assert_same_tensors(job.params(), after_one_more)


def test_fresh_objects_load_the_checkpoint(tmp_path):
    """A restarted job builds new objects (optimizer not stepped yet) and loads into them."""
    job = Job()
    job.step(0)
    job.step(1)
    CheckpointManager(tmp_path).save(2, job.state())
    fresh = Job(seed=7)
    state = fresh.state()
    CheckpointManager(tmp_path).load(state)
    assert_same_tensors(fresh.params(), job.params())
    assert_same_optimizer(fresh.opt.state_dict(), job.opt.state_dict())
    assert fresh.sched.state_dict() == job.sched.state_dict()
    assert state["train_state"] == {"step": 2, "tokens": 80}


def make_crashed_save(folder: Path, step: int) -> Path:
    """What a crash mid-save leaves: a step directory with some shards and no marker."""
    ckpt = folder / f"step-{step}"
    (ckpt / "rank_state").mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(b"partial")
    return ckpt


def test_latest_step_and_load_ignore_incomplete_directories(tmp_path):
    job = Job()
    ckpt = CheckpointManager(tmp_path)
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        ckpt.load(job.state())
    for step in (1, 2):
        job.step(step)
        ckpt.save(step, job.state())
    make_crashed_save(tmp_path, 9)
    (tmp_path / "step-notanumber").mkdir()
    (tmp_path / "step-12").write_text("a file, not a directory")
    assert ckpt.latest_step() == 2
    assert json.loads((tmp_path / "step-2" / MARKER).read_text())["world_size"] == 1

    expected = job.params()
    job.step(5)
    state = job.state()
    ckpt.load(state)
    assert state["train_state"]["step"] == 2
    assert_same_tensors(job.params(), expected)

    for bad in ({"step": 9}, {"step": 7}, {"path": tmp_path / "step-9"}):
        with pytest.raises(FileNotFoundError, match=str(tmp_path)):
            ckpt.load(job.state(), **bad)
    with pytest.raises(FileNotFoundError, match="step-1, step-2"):
        ckpt.load(job.state(), step=9)
    with pytest.raises(FileNotFoundError):
        ckpt.saved_world_size(9)
    ckpt.load(job.state(), path=tmp_path / "step-1")
    assert job.train_state["step"] == 1


def test_keep_latest_k_retention(tmp_path):
    job = Job()
    ckpt = CheckpointManager(tmp_path, keep_latest_k=2)
    ckpt.save(10, job.state())
    make_crashed_save(tmp_path, 5)  # older than the newest complete one: removed
    make_crashed_save(tmp_path, 15)
    for step in (20, 30):
        ckpt.save(step, job.state())
    make_crashed_save(tmp_path, 50)  # newer than every complete one: kept (it may be in progress)
    ckpt.save(40, job.state())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-30", "step-40", "step-50"]
    assert ckpt.latest_step() == 40

    # A repeated step replaces the directory, marker last; leftovers of a crashed save of it too.
    make_crashed_save(tmp_path, 60)
    (tmp_path / "step-60" / "stale.distcp").write_bytes(b"x")
    ckpt.save(60, job.state())
    assert not (tmp_path / "step-60" / "stale.distcp").exists()
    assert ckpt.latest_step() == 60


def test_rank_state_round_trip_and_world_size_change(tmp_path):
    job = Job()
    random.seed(3)
    np.random.seed(3)
    rank_state = {
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_key": np.random.get_state()[1].tolist(),  # numpy arrays do not load with weights_only=True
        "loader": {"windows": 17, "epoch": 2},
    }
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(4, job.state(), rank_state)
    assert (tmp_path / "step-4" / "rank_state" / "rank-0.pt").is_file()
    back = ckpt.load(job.state())
    assert torch.equal(back["torch_rng"], rank_state["torch_rng"])
    assert back["python_rng"] == rank_state["python_rng"]
    assert back["loader"] == rank_state["loader"]
    assert back["numpy_key"] == rank_state["numpy_key"]
    with pytest.raises(TypeError, match="weights_only"):  # refused at save time, not discovered at resume
        ckpt.save(5, job.state(), {"numpy_rng": np.random.get_state()})
    assert not (tmp_path / "step-5").exists()

    # Saved by "rank 0 of 2": same files, but a world size of 1 must not reuse per-rank state.
    CheckpointManager(tmp_path, rank=0, world_size=2).save(8, job.state(), rank_state)
    assert ckpt.saved_world_size(8) == 2 and ckpt.saved_world_size(4) == 1
    assert ckpt.load(job.state()) is None
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, rank=2, world_size=2)


def test_load_model_only(tmp_path):
    job = Job()
    job.step(0)
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(1, job.state())
    job.step(1)
    ckpt.save(2, job.state())
    for where, step in ((tmp_path, 2), (tmp_path / "step-1", 1)):
        model = tiny_model(seed=5)
        assert load_model_only(model, where) == tmp_path / f"step-{step}"
        expected = CheckpointManager(tmp_path)
        other = Job(seed=9)
        expected.load(other.state(), step=step)
        assert_same_tensors(model.state_dict(), other.model.state_dict())
    with pytest.raises(FileNotFoundError):
        load_model_only(tiny_model(), tmp_path / "step-3")


@pytest.mark.slow  # importing torch.compile's machinery takes seconds
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised by that import, not by us
def test_compiled_and_wrapped_models_share_names_with_plain_ones(tmp_path):
    """torch.compile and activation checkpointing rename submodules (`_orig_mod.`,
    `_checkpoint_wrapped_module.`); checkpoints use the clean names either way."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    job = Job()
    job.step(0)
    wrapped = tiny_model(seed=2)
    wrapped[0] = torch.compile(wrapped[0])  # never called: wrapping alone changes the names
    wrapped[2] = checkpoint_wrapper(wrapped[2])
    names = {name for name, _ in wrapped.named_parameters()}
    assert "0._orig_mod.weight" in names and "2._checkpoint_wrapped_module.weight" in names

    def clean(sd):
        return {k.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): v for k, v in sd.items()}

    CheckpointManager(tmp_path / "plain").save(1, job.state())
    load_model_only(wrapped, tmp_path / "plain")
    assert_same_tensors(clean(wrapped.state_dict()), job.params())

    opt = torch.optim.AdamW(wrapped.parameters())
    CheckpointManager(tmp_path / "wrapped").save(
        1, {"model": model_state(wrapped), "optimizer": optimizer_state(wrapped, opt)}
    )
    plain = tiny_model(seed=4)
    load_model_only(plain, tmp_path / "wrapped")
    assert_same_tensors(plain.state_dict(), job.params())


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight


def test_safetensors_export_and_load(tmp_path):
    job = Job()
    job.step(0)
    path = export_safetensors(job.model, tmp_path / "out" / "model.safetensors")
    assert path.is_file()
    fresh = tiny_model(seed=3)
    load_safetensors(fresh, path)
    assert_same_tensors(fresh.state_dict(), job.params())

    half = export_safetensors(job.model, tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    from safetensors.torch import load_file

    assert all(t.dtype == torch.bfloat16 for t in load_file(str(half)).values())

    torch.manual_seed(0)
    tied = Tied()
    export_safetensors(tied, tmp_path / "tied.safetensors")  # shared storage must not break the export
    fresh_tied = Tied()
    load_safetensors(fresh_tied, tmp_path / "tied.safetensors")
    assert torch.equal(fresh_tied.embed.weight, tied.embed.weight)
    assert fresh_tied.head.weight is fresh_tied.embed.weight


@pytest.fixture
def synced(monkeypatch):
    """The paths os.fsync is called on, in order."""
    paths: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (paths.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    return paths


def test_exported_weights_are_world_readable_and_synced(tmp_path, synced):
    """safetensors' save_file makes its file 0o600; the export gets a plain file's mode, synced to the disk."""
    old = os.umask(0o022)
    try:
        path = export_safetensors(Job().model, tmp_path / "model.safetensors")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
    assert [Path(p).name.startswith(".model.safetensors.") for p in synced] == [True, False]  # file, then folder
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_marker_and_rank_files_are_synced_before_the_save_returns(tmp_path, synced):
    job = Job()
    job.step(0)
    CheckpointManager(tmp_path).save(1, job.state(), {"r": 1})
    names = [Path(p).name for p in synced]
    assert any(n.startswith(".rank-0.pt.") for n in names) and any(n.startswith(f".{MARKER}.") for n in names)
    assert names[-1] == "step-1"  # the folder, once COMPLETE is in it


def test_async_save_completes_on_wait_next_save_and_close(tmp_path):
    job = Job()
    job.step(0)
    ckpt = CheckpointManager(tmp_path, async_save=True, keep_latest_k=1)
    ckpt.save(1, job.state(), {"r": 1})
    expected = job.params()
    with torch.no_grad():  # training goes on while the write runs: the checkpoint holds a CPU copy
        for p in job.model.parameters():
            p.add_(1.0)
    assert not (tmp_path / "step-1" / MARKER).exists()
    assert ckpt.latest_step() is None
    ckpt.wait()
    assert (tmp_path / "step-1" / MARKER).is_file() and ckpt.latest_step() == 1
    ckpt.wait()  # nothing in flight: a no-op

    ckpt.save(2, job.state())
    assert ckpt.latest_step() == 1
    ckpt.save(3, job.state())  # finishes step 2 first; retention (k=1) then drops step 1
    assert ckpt.latest_step() == 2 and not (tmp_path / "step-1").exists()
    ckpt.close()
    assert ckpt.latest_step() == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]
    ckpt.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.save(4, job.state())

    fresh = Job(seed=4)
    assert load_model_only(fresh.model, tmp_path / "step-3")
    assert_same_tensors(fresh.params(), {k: v + 1.0 for k, v in expected.items()})
    with CheckpointManager(tmp_path, async_save=True) as again:
        again.save(5, job.state())
    assert (tmp_path / "step-5" / MARKER).is_file()  # the context manager closes, so it completes


def test_project_optimizers_and_schedules_round_trip(tmp_path):
    """The real thing on CPU: debug ATMA, Muon + AdamW (atma_titan.optim.Optimizers), LRSchedules."""
    import torch.nn.functional as F

    from atma_titan.config import JobConfig
    from atma_titan.optim import LRSchedules, build_optimizers
    from atma_titan.models import build_model, resolve_model_args

    cfg = JobConfig()

    def build():
        model = build_model(resolve_model_args(cfg.model), torch.device("cpu"), seed=cfg.job.seed)
        opts = build_optimizers(model, cfg.optimizer)
        return model, opts, LRSchedules(opts, cfg.lr_scheduler, total_steps=10)

    def step(model, opts, scheds, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, model.args.vocab_size, (2, 17), generator=g)
        logits = model(x[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        opts.step()
        scheds.step()
        opts.zero_grad()

    def state(model, opts, scheds):
        return {"model": model_state(model), "optimizer": optimizer_state(model, opts), "lr_scheduler": scheds}

    model, opts, scheds = build()
    step(model, opts, scheds, 0)
    CheckpointManager(tmp_path).save(1, state(model, opts, scheds))
    step(model, opts, scheds, 1)

    model2, opts2, scheds2 = build()
    CheckpointManager(tmp_path).load(state(model2, opts2, scheds2))
    step(model2, opts2, scheds2, 1)
    assert_same_tensors(model2.state_dict(), model.state_dict())
    assert [g["lr"] for g in opts2.param_groups] == [g["lr"] for g in opts.param_groups]


# ---------------------------------------------------------------------------------------------
# Two ranks over gloo with FSDP2 <-> one plain process
# ---------------------------------------------------------------------------------------------

WORKER = textwrap.dedent('''
    """Run as one rank of a gloo job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment),
    or import for tiny_model / snapshot in a single process."""
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from atma_titan.checkpoint.manager import CheckpointManager, load_model_only, model_state, optimizer_state
    from atma_titan.checkpoint.weights import export_safetensors, load_safetensors
    from atma_titan.run.folder import COMPLETE_NAME as MARKER


    def tiny_model(seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 3))


    def make_optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


    def train_step(model, opt, seed):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for group in opt.param_groups:  # as a schedule would: a fresh optimizer must get this lr back
            group["lr"] *= 0.5


    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


    def snapshot(model, opt):
        """Every model and optimizer tensor by FQN, unsharded (collective under FSDP2)."""
        out = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
        out["lr"] = torch.tensor([g["lr"] for g in opt.param_groups], dtype=torch.float64)
        for fqn, values in get_optimizer_state_dict(model, opt)["state"].items():
            for k, v in values.items():
                out[f"optim.{fqn}.{k}"] = full(v)
        return out


    def state(model, opt, step=0):
        return {"model": model_state(model), "optimizer": optimizer_state(model, opt),
                "train_state": {"step": step}}


    def check_equal(got, want):
        assert got.keys() == want.keys(), (sorted(got), sorted(want))
        for k in want:
            assert torch.equal(got[k], want[k]), k


    def sharded_model(mesh, seed=0):
        from torch.distributed.fsdp import fully_shard
        model = tiny_model(seed)
        for layer in (model[0], model[2]):  # model[4] stays with the root's parameter group
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model


    def save_here(folder, expected_file):
        """Train one step on 2 ranks, save; reload at the same world size; an async save; export."""
        rank = dist.get_rank()
        mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
        model = sharded_model(mesh)
        opt = make_optimizer(model)
        train_step(model, opt, seed=1)
        assert isinstance(model[0].weight, DTensor)
        ckpt = CheckpointManager(folder, keep_latest_k=3)
        rank_state = {"rank": rank, "rng": torch.get_rng_state(), "windows": 100 + rank}
        ckpt.save(1, state(model, opt, step=1), rank_state)
        want = snapshot(model, opt)
        if rank == 0:
            torch.save(want, expected_file)

        train_step(model, opt, seed=2)  # perturb, then load back at the same world size
        loaded = state(model, opt)
        back = ckpt.load(loaded)
        assert back["rank"] == rank and back["windows"] == 100 + rank
        assert torch.equal(back["rng"], rank_state["rng"])
        assert loaded["train_state"] == {"step": 1}
        check_equal(snapshot(model, opt), want)

        export_safetensors(model, Path(folder) / "model.safetensors")

        with CheckpointManager(Path(folder) / "async", async_save=True) as slow:
            slow.save(1, state(model, opt, step=1), rank_state)
            assert not (Path(folder) / "async" / "step-1" / MARKER).exists()
        assert slow.latest_step() == 1  # every rank sees it: close() ends in a barrier
        ckpt.close()


    def load_here(folder, expected_file):
        """Load a checkpoint saved by one plain process into a 2-rank FSDP2 model and optimizer."""
        mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
        model = sharded_model(mesh, seed=5)
        opt = make_optimizer(model)
        ckpt = CheckpointManager(folder)
        loaded = state(model, opt)
        assert ckpt.load(loaded) is None  # saved at world size 1: no per-rank state to reuse
        assert loaded["train_state"] == {"step": 1}
        want = torch.load(expected_file)
        check_equal(snapshot(model, opt), want)

        weights = {k: v for k, v in want.items() if k.startswith("model.")}
        only = sharded_model(mesh, seed=6)
        load_model_only(only, folder)
        check_equal({f"model.{k}": full(v) for k, v in only.state_dict().items()}, weights)
        from_st = sharded_model(mesh, seed=7)
        load_safetensors(from_st, Path(folder) / "model.safetensors")
        check_equal({f"model.{k}": full(v) for k, v in from_st.state_dict().items()}, weights)
        ckpt.close()


    if __name__ == "__main__":
        import torch.distributed.device_mesh  # noqa: F401  (dist.device_mesh above)
        mode, folder, expected_file = sys.argv[1:4]
        dist.init_process_group("gloo")
        try:
            {"save": save_here, "load": load_here}[mode](folder, expected_file)
        finally:
            dist.destroy_process_group()
''')


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "ckpt_worker.py"
    path.write_text(WORKER)
    spec = importlib.util.spec_from_file_location("ckpt_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, *args: str, world_size: int = 2, timeout: float = 120) -> None:
    """Start `world_size` ranks of `script`; fail (never hang) if one fails or the job times out."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks of {script.name} {args[0]} did not finish in {timeout} s")
    finally:
        for p in procs:  # each rank leads its own process group: kill it with whatever it started
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{out}"


@pytest.mark.slow
def test_save_on_two_fsdp_ranks_load_in_one_plain_process(tmp_path, worker):
    folder, expected_file = tmp_path / "ckpt", tmp_path / "expected.pt"
    run_ranks(tmp_path / "ckpt_worker.py", "save", str(folder), str(expected_file))
    want = torch.load(expected_file)

    ckpt = CheckpointManager(folder)
    assert ckpt.latest_step() == 1 and ckpt.saved_world_size(1) == 2
    assert sorted(p.name for p in (folder / "step-1" / "rank_state").iterdir()) == ["rank-0.pt", "rank-1.pt"]
    model = worker.tiny_model(seed=9)
    opt = worker.make_optimizer(model)  # never stepped: its state is created to load into
    loaded = worker.state(model, opt)
    assert ckpt.load(loaded) is None  # 2 ranks saved, 1 loads: per-rank state is not reused
    assert loaded["train_state"] == {"step": 1}
    worker.check_equal(worker.snapshot(model, opt), want)

    weights = {k: v for k, v in want.items() if k.startswith("model.")}
    only = worker.tiny_model(seed=10)
    load_model_only(only, folder)
    worker.check_equal({f"model.{k}": v for k, v in only.state_dict().items()}, weights)
    from_st = worker.tiny_model(seed=11)
    load_safetensors(from_st, folder / "model.safetensors")
    worker.check_equal({f"model.{k}": v for k, v in from_st.state_dict().items()}, weights)
    assert CheckpointManager(folder / "async").saved_world_size(1) == 2


@pytest.mark.slow
def test_save_in_one_plain_process_load_on_two_fsdp_ranks(tmp_path, worker):
    folder, expected_file = tmp_path / "ckpt", tmp_path / "expected.pt"
    model = worker.tiny_model(seed=0)
    opt = worker.make_optimizer(model)
    worker.train_step(model, opt, seed=1)
    CheckpointManager(folder).save(1, worker.state(model, opt, step=1), {"rank": 0})
    export_safetensors(model, folder / "model.safetensors")
    torch.save(worker.snapshot(model, opt), expected_file)
    run_ranks(tmp_path / "ckpt_worker.py", "load", str(folder), str(expected_file))
