"""Peak GPU memory of training, measured, beside the dry run's estimate (atma_titan/parallel/memory_plan.py).

    python benchmarks/train/memory_peaks.py                    # one GPU: blocks, the head, then trainer runs
    python benchmarks/train/memory_peaks.py --parts runs --variants recipe,mb32

blocks: one block of each type of the config's model, in bf16, compiled, under each AC mode, at the config's
micro-batch: the bytes per token it keeps for its backward (its input and output left out) and the most
alive above that in its backward; and the fused LM-head loss at the same tokens: what it keeps and the most
alive above that while it runs. runs: the trainer under torchrun on one rank, a few steps of each variant on
synthetic data: torch.cuda.max_memory_allocated (the trainer's `mem`), max_memory_reserved, and what the
process takes of the device (cudaMemGetInfo), beside the plan's estimate of each and its error.
Results: benchmarks/results/memory_peaks-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: atma_titan, benchmarks.common

from atma_titan.config import load_config  # noqa: E402
from atma_titan.models.atma import ATMA, Block  # noqa: E402
from atma_titan.models.flavors import resolve_model_args  # noqa: E402
from atma_titan.models.loss import linear_softcap_cross_entropy  # noqa: E402
from atma_titan.parallel.memory_plan import GiB, plan_memory, step_of  # noqa: E402
from atma_titan.parallel.parallelize import apply_activation_checkpointing  # noqa: E402
from benchmarks.common import result_path, write_json  # noqa: E402

TRAIN = ["--data.source", "synthetic", "--data.tokenizer", "byte", "--checkpoint.enable", "false"]
VARIANTS = {  # name -> trainer flags on top of the config's
    "recipe": [],
    "acall": ["--activation_checkpoint.blocks", "all"],
    "noac": ["--activation_checkpoint.mode", "none"],
    "step32k": ["--training.batch_tokens", "32768"],
    "l4": ["--training.micro_batch_size", "8"],
    "l4_full": ["--training.micro_batch_size", "8", "--activation_checkpoint.mode", "full"],
    "mb32": ["--training.micro_batch_size", "32"],
    "mb32_noac": ["--training.micro_batch_size", "32", "--activation_checkpoint.mode", "none"],
    "full_all": ["--activation_checkpoint.mode", "full", "--activation_checkpoint.blocks", "all"],
    "mb4_acall": ["--training.micro_batch_size", "4", "--activation_checkpoint.blocks", "all"],
}
DEFAULT_VARIANTS = "recipe,mb32,mb32_noac,full_all,mb4_acall"


class _Holder(nn.Module):  # what apply_activation_checkpointing reads: .blocks and .args
    def __init__(self, block: nn.Module, args):
        super().__init__()
        self.blocks = nn.ModuleDict({"0": block})
        self.args = args


def measure_block(args, layer: int, mode: str, micro_batch: int, seq_len: int) -> dict:
    torch.manual_seed(0)
    block = Block(args, layer).cuda().to(torch.bfloat16)  # as FSDP2 gathers it
    holder = _Holder(block, args)
    apply_activation_checkpointing(holder, mode, 1, "matmuls", "all")
    compiled = torch.compile(holder.blocks["0"], fullgraph=True)
    x = torch.randn(micro_batch, seq_len, args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    tokens = micro_batch * seq_len
    for _ in range(3):  # the first compiles and autotunes
        block.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out, _ = compiled(x)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out.backward(grad)
        torch.cuda.synchronize()
        backward_peak = torch.cuda.max_memory_allocated()
        del out
    torch._dynamo.reset()
    return {
        "block": "global" if block.is_global else "local",
        "mode": mode,
        "tokens": tokens,
        "kept_bytes_per_token": (after - base - x.numel() * x.element_size()) / tokens,
        "backward_above_kept_bytes_per_token": (backward_peak - after) / tokens,
    }


def measure_head(args, tokens: int, chunk_mib: float) -> dict:
    weight = torch.randn(args.vocab_size, args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(args.vocab_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    hidden = torch.randn(tokens, args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, args.vocab_size, (tokens,), device="cuda")
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = linear_softcap_cross_entropy(hidden, weight, bias, labels, cap=args.logit_softcap, chunk_mib=chunk_mib)
        torch.cuda.synchronize()
        after, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        loss.backward()
        weight.grad = bias.grad = hidden.grad = None
    return {
        "tokens": tokens,
        "chunk_mib": chunk_mib,
        "kept_bytes": after - base,
        "running_above_kept_bytes": peak - after,
    }


def child(out: str, flags: list[str]) -> None:
    """Under torchrun: train, then write the allocator's and the device's peaks."""
    from atma_titan.train import train

    began = time.time()
    train(load_config(flags))
    free, total = torch.cuda.mem_get_info()
    row = {
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "reserved": torch.cuda.memory_reserved(),
        "device_used": total - free,
        "device_total": total,
        "seconds": time.time() - began,
    }
    Path(out).write_text(json.dumps(row))


def run_variant(name: str, config: str, steps: int, extra: list[str], timeout: float) -> dict:
    flags = ["--config", config, *TRAIN, *VARIANTS[name], *extra, "--training.steps", str(steps)]
    flags += ["--metrics.log_freq", "1", "--job.print_config", "false"]
    cfg = load_config(flags)
    with torch.device("meta"):
        model = ATMA(resolve_model_args(cfg.model))
    plan = plan_memory(model, cfg.optimizer.name, step_of(cfg, 1))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()  # this process's context and cache (the blocks part), if any
    others = total - free
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "peaks.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", __file__]
        cmd += ["--child", str(out), "--", *flags, "--job.dump_folder", str(Path(folder) / "run")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            return {"variant": name, "error": (proc.stdout + proc.stderr)[-3000:]}
        measured = json.loads(out.read_text())
    measured["device_used"] -= others  # the trainer's process alone
    return {
        "variant": name,
        "flags": VARIANTS[name],
        **measured,
        "estimated_allocated": plan.allocated,
        "estimated_reserved": plan.allocated + plan.reserve,
        "estimated_device": plan.device,
        "error_allocated": plan.allocated / measured["max_allocated"] - 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/atma_370m.toml")
    parser.add_argument("--parts", default="blocks,runs", help="blocks, runs or both")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per trainer run")
    parser.add_argument("--tag", help="name the file memory_peaks-<tag>.json instead")
    parser.add_argument("--out", default=None, help="a results folder or a .json file (default benchmarks/results/)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts, extra = parser.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if opts.child:
        return child(opts.child, extra)
    if not torch.cuda.is_available():
        raise SystemExit("memory_peaks.py measures a GPU's memory: no CUDA device here")
    cfg = load_config(["--config", opts.config, *extra])
    args = resolve_model_args(cfg.model)
    result = {
        "config": opts.config,
        "overrides": extra,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    parts = opts.parts.split(",")
    if "blocks" in parts:
        t = cfg.training
        result["head"] = measure_head(args, t.micro_batch_size * t.seq_len, t.loss_chunk_mib)
        print(json.dumps(result["head"]), flush=True)
        layers = {"local": next(i for i in range(args.n_layers) if not args.is_global(i))}
        if args.global_layers:
            layers["global"] = args.global_layers[0]
        result["blocks"] = []
        for layer in layers.values():
            for mode in ("none", "selective", "full"):
                result["blocks"].append(measure_block(args, layer, mode, t.micro_batch_size, t.seq_len))
                print(json.dumps(result["blocks"][-1]), flush=True)
    if "runs" in parts:
        result["runs"] = []
        for name in opts.variants.split(","):
            row = run_variant(name, opts.config, opts.steps, extra, opts.timeout)
            result["runs"].append(row)
            if "error" in row:
                print(f"{name}: failed\n{row['error']}", flush=True)
                continue
            allocated, estimated = row["max_allocated"] / GiB, row["estimated_allocated"] / GiB
            print(
                f"{name:<10} allocated {allocated:6.2f} GiB (estimated {estimated:6.2f}, "
                f"{row['error_allocated']:+.1%}), "
                f"reserved {row['max_reserved'] / GiB:6.2f}, device {row['device_used'] / GiB:6.2f} of "
                f"{row['device_total'] / GiB:.1f} GiB",
                flush=True,
            )
    write_json(result_path("memory_peaks", opts.out, tag=opts.tag), result)


if __name__ == "__main__":
    main()
