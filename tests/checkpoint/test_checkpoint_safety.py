"""No code runs from checkpoint files: crafted rank files, .metadata and DCP values are refused (the run falls
back or exits 2), and eval / generate turn corrupt checkpoints and .safetensors into exit 2 without a traceback."""

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from atma_titan.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    UnsafeCheckpointError,
    load_model_only,
    model_state,
)
from atma_titan.checkpoint.manifest import hash_file, read_marker, write_marker
from atma_titan.config import load_config
from atma_titan.checkpoint.safe_unpickle import read_metadata_file

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class RunsACommand:
    """Unpickling this runs `touch <marker>`: what a malicious checkpoint file would hold."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def save_two(folder: Path) -> nn.Module:
    model = nn.Linear(4, 3)
    ckpt = CheckpointManager(folder)
    for step in (1, 2):
        ckpt.save(step, {"model": model_state(model), "train_state": {"step": step}}, {"step": step})
    return model


def matching_manifest(ckpt: Path, name: str) -> None:
    """Rewrite COMPLETE so its manifest matches `name` as it is now: the digests cannot save us."""
    raw = json.loads((ckpt / "COMPLETE").read_text())
    info = {k: raw[k] for k in ("step", "world_size", "time", "torch", "load_step")}
    write_marker(ckpt, info, {**read_marker(ckpt).files, name: hash_file(ckpt / name)})


def load_state(folder: Path) -> tuple[dict, dict | None]:
    state = {"model": model_state(nn.Linear(4, 3)), "train_state": {"step": -1}}
    return state, CheckpointManager(folder).load(state)


def test_crafted_rank_file_does_not_run_and_the_run_falls_back(tmp_path):
    marker = tmp_path / "ran"
    save_two(tmp_path / "ck")
    ckpt = tmp_path / "ck" / "step-2"
    torch.save({"loader": RunsACommand(marker)}, ckpt / "rank_state" / "rank-0.pt")
    matching_manifest(ckpt, "rank_state/rank-0.pt")
    with pytest.warns(CheckpointWarning) as warned:
        state, rank_state = load_state(tmp_path / "ck")
    assert not marker.exists()
    assert state["train_state"]["step"] == 1 and rank_state == {"step": 1}
    message = str(warned[0].message)
    assert "step-2 is damaged and is skipped: rank_state/rank-0.pt: refused by torch.load(weights_only=True)" in message
    assert "GLOBAL posix.system" in message


def test_crafted_metadata_does_not_run_and_the_run_falls_back(tmp_path):
    marker = tmp_path / "ran"
    save_two(tmp_path / "ck")
    ckpt = tmp_path / "ck" / "step-2"
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))
    matching_manifest(ckpt, ".metadata")
    with pytest.warns(CheckpointWarning, match=r"\.metadata: refusing to unpickle posix\.system"):
        state, _ = load_state(tmp_path / "ck")
    assert not marker.exists() and state["train_state"]["step"] == 1

    # The only checkpoint, and one without a manifest: refused all the same, as an InputError.
    (tmp_path / "ck" / "step-1" / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))
    (tmp_path / "ck" / "step-1" / "COMPLETE").write_text(json.dumps({"step": 1, "world_size": 1}))
    shutil.rmtree(ckpt)
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match=r"step-1: \.metadata: refusing"):
        load_state(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="refusing to unpickle posix.system"):
        load_model_only(nn.Linear(4, 3), tmp_path / "ck")
    assert not marker.exists()


def test_crafted_value_inside_a_distcp_file_does_not_run(tmp_path):
    """DCP's own planner loads non-tensor values with weights_only=False; ours does not."""
    marker = tmp_path / "ran"
    CheckpointManager(tmp_path).save(1, {"model": model_state(nn.Linear(4, 3)), "extra": {"x": RunsACommand(marker)}})
    state = {"model": model_state(nn.Linear(4, 3)), "extra": {"x": None}}
    with pytest.raises(CheckpointError) as raised:  # it verifies (the save was genuine): dcp.load refuses
        CheckpointManager(tmp_path).load(state)
    assert not marker.exists()
    message = str(raised.value)
    assert f"loading checkpoint {tmp_path / 'step-1'} failed: rank 0: __0_0.distcp: the value of 'extra.x'" in message


def test_metadata_unpickler_admits_dcp_types_and_nothing_else(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(pickle.dumps((torch.bfloat16, torch.Size([2, 3]), torch.strided)))
    with pytest.raises(CheckpointError, match="holds a tuple, not DCP metadata"):
        read_metadata_file(path)  # every type was admitted; only the top-level object is wrong
    path.write_bytes(pickle.dumps(print))
    with pytest.raises(UnsafeCheckpointError, match=rf"^{path}: refusing to unpickle builtins\.print"):
        read_metadata_file(path)
    path.write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=rf"^{path} is unreadable"):
        read_metadata_file(path)


# ---------------------------------------------------------------------------------------------
# eval and generate


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """What a run folder holds for eval and generate: config.toml, checkpoints step-1 and step-2, model.safetensors."""
    from atma_titan.checkpoint.weights import export_safetensors
    from atma_titan.models import build_model, resolve_model_args

    dump = tmp_path_factory.mktemp("run")
    cfg = load_config(["--config", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder", str(dump)])
    (dump / "config.toml").write_text(cfg.to_toml())
    model = build_model(resolve_model_args(cfg.model), torch.device("cpu"), seed=0)
    ckpt = CheckpointManager(dump / "checkpoints")
    for step in (1, 2):
        ckpt.save(step, {"model": model_state(model)})
    export_safetensors(model, dump / "model.safetensors")
    return dump


def damaged_copy(run_dir: Path, tmp_path: Path, case: str) -> tuple[Path, str]:
    """A copy of the run with one kind of damage; the --checkpoint to pass and what the error must say."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    step = run / "checkpoints" / "step-2"
    if case == "safetensors":
        weights = run / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        return weights, f"{weights} is not a readable .safetensors file"
    if case == "no_metadata":
        (step / ".metadata").unlink()
        return step, f"checkpoint {step} is damaged: .metadata: missing"
    flip_a_bit(step / "__0_0.distcp")
    return step, f"checkpoint {step} is damaged: __0_0.distcp: xxh3_64"


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("command", ["eval", "generate"])
@pytest.mark.parametrize("case", ["safetensors", "no_metadata", "damaged"])
def test_eval_and_generate_exit_2_on_damaged_weights(run_dir, tmp_path, capsys, command, case):
    from atma_titan.eval.__main__ import main as eval_main
    from atma_titan.generate import main as generate_main

    where, message = damaged_copy(run_dir, tmp_path, case)
    if command == "eval":
        code = eval_main(["--checkpoint", str(where), "--trials", "1", "--out", str(tmp_path / "out")])
    else:
        code = generate_main(["--checkpoint", str(where), "--prompt", "x", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err, err
    if case == "damaged":
        assert "other complete checkpoints beside it: step-1 (--step N chooses one)" in err  # what --step could pick


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_eval_and_generate_on_a_folder_skip_its_damaged_newest_checkpoint_as_training_does(
    run_dir, tmp_path, capsys, command
):
    from atma_titan.eval.__main__ import main as eval_main
    from atma_titan.generate import main as generate_main

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    flip_a_bit(run / "checkpoints" / "step-2" / "__0_0.distcp")
    (run / "model.safetensors").unlink()
    if command == "eval":
        code = eval_main(["--checkpoint", str(run), "--trials", "1", "--records", "--gaps", "32", "--out",
                          str(tmp_path / "out")])  # fmt: skip
    else:
        code = generate_main(["--checkpoint", str(run), "--prompt", "x", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "warning: skipped the damaged step-2 (__0_0.distcp: xxh3_64" in err and "using step-1" in err
