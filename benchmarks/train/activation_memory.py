"""Peak memory and recomputed work of each activation-checkpointing policy, on CPU, allocating nothing.

    python benchmarks/train/activation_memory.py --config train_configs/atma_370m.toml --micro-batch 16

One forward + backward of the model (the Triton kernels' ops, bf16 weights and activations) runs on fake
tensors (FakeTensorMode): PyTorch's MemTracker follows every tensor and reports the peak, and FLOPs are
counted per op, so the forward work that each policy repeats in backward is exact. Eager, not compiled:
Inductor's partitioner also recomputes some elementwise ops by itself, so the GPU's peaks are lower
(benchmarks/train/train_speed.py measures those); the policies' order and differences are what this shows.
Parameters, gradients and the logits' (tokens x vocab) buffers are left out: this is the activations'
share of a training step's peak. Results: benchmarks/results/activation_memory-cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.config import load_config  # noqa: E402
from atma_titan.models.atma import ATMA  # noqa: E402
from atma_titan.models.flavors import resolve_model_args  # noqa: E402
from benchmarks.common import result_path, write_json  # noqa: E402

parallelize = importlib.import_module("atma_titan.parallel.parallelize")

GiB = 1 << 30
# The fused kernels among the ops selective AC always keeps (their forwards are what recomputing repeats).
KERNEL_OPS = {op._schema.name for op in parallelize._KERNEL_OPS if op.namespace == "atma"}


POLICIES = {  # name -> apply_activation_checkpointing's keywords ([activation_checkpoint] in a config)
    "none": {"mode": "none"},
    "selective, save = matmuls": {"mode": "selective", "save": "matmuls"},
    "selective, save = narrow_matmuls": {"mode": "selective", "save": "narrow_matmuls"},
    "selective, save = kernels": {"mode": "selective", "save": "kernels"},
    "selective, global blocks": {"mode": "selective", "blocks": "global"},
    "full, every_n = 2": {"mode": "full", "every_n": 2},
    "full": {"mode": "full"},
}


class KernelCalls(TorchDispatchMode):
    """Counts the calls of the fused kernels' forward ops (recomputing them repeats their forward)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in KERNEL_OPS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def step(args, micro_batch: int, seq_len: int, ac: dict, *modes) -> None:
    """One forward + backward on fake tensors under `modes` (entered in order)."""
    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)  # the bf16 params of FSDP's mixed precision
        try:
            model = ATMA(args)
        finally:
            torch.set_default_dtype(torch.float32)
        parallelize.apply_activation_checkpointing(model, **ac)
        tokens = torch.randint(0, args.vocab_size, (micro_batch, seq_len))
        for mode in modes:
            if isinstance(mode, MemTracker):
                mode.track_external(model)
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            hidden, _ = model.trunk(tokens)
            hidden.float().square().mean().backward()  # a stand-in loss: the head's buffers are not counted


def measure(args, micro_batch: int, seq_len: int, ac: dict) -> dict:
    # Two passes: the FLOP counter's module hooks keep tensors alive, which the memory tracker would count.
    tracker = MemTracker()
    step(args, micro_batch, seq_len, ac, tracker)
    flops, kernels = FlopCounterMode(display=False), KernelCalls()
    step(args, micro_batch, seq_len, ac, flops, kernels)
    peak = tracker.get_tracker_snapshot("peak")
    by_kind = {str(k).split(".")[-1]: v for kinds in peak.values() for k, v in kinds.items()}  # at the peak
    return {
        "peak_activation_gib": by_kind["ACT"] / GiB,
        "peak_temp_gib": by_kind["TEMP"] / GiB,
        "matmul_tflop": sum(flops.get_flop_counts()["Global"].values()) / 1e12,
        "kernel_forward_calls": sum(kernels.calls.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/atma_370m.toml")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the config's training.seq_len")
    parser.add_argument("--tag", help="name the file activation_memory-<tag>.json instead")
    parser.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    opts, overrides = parser.parse_known_args()
    cfg = load_config(["--config", opts.config, *[x for x in overrides if x != "--"]])
    # The kernels' ops (their fake implementations) stand for what the GPU saves.
    args = dataclasses.replace(resolve_model_args(cfg.model), attention_impl="triton", memory_impl="triton")
    seq_len = opts.seq_len or cfg.training.seq_len
    print(f"{cfg.model.flavor}: micro-batch {opts.micro_batch} x {seq_len} tokens, bf16, eager, fake tensors")
    rows = []
    for name, ac in POLICIES.items():
        began = time.perf_counter()
        rows.append({"policy": name, **ac, **measure(args, opts.micro_batch, seq_len, ac)})
        print(f"  {name}: {time.perf_counter() - began:.0f} s", flush=True)
    base = rows[0]
    header = f"{'activations GiB':>16} {'temp GiB':>9} {'matmul TFLOP':>13} {'vs none':>8} {'kernel fwd':>11}"
    print(f"\n{'policy':<36} {header}")
    for r in rows:
        extra = r["matmul_tflop"] / base["matmul_tflop"] - 1
        print(
            f"{r['policy']:<36} {r['peak_activation_gib']:>16.1f} {r['peak_temp_gib']:>9.1f} "
            f"{r['matmul_tflop']:>13.1f} {extra:>+8.1%} {r['kernel_forward_calls']:>11}"
        )
    meta = {"config": opts.config, "overrides": overrides, "micro_batch": opts.micro_batch, "seq_len": seq_len}
    write_json(result_path("activation_memory", opts.out, "cpu", opts.tag), {**meta, "rows": rows})


if __name__ == "__main__":
    main()
