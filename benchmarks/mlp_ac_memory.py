"""Compiled blocks under each activation-checkpointing mode, with autograd's MLP backward and with the GLU pass
(`_GLUMLP`, atma_titan.kernels.glu): time of a forward + backward, activations held after the forward, and
the peak, over 4 of the 370M model's LFM2 blocks at a micro-batch of 8 x 2,048 (the L4 config's), one run.

    python benchmarks/mlp_ac_memory.py [--out benchmarks/results/]

The AC modes are the trainer's (atma_titan/parallel/parallelize.py): full, selective keeping every matmul's
output (the recipe), selective recomputing the MLP's up-projection (narrow_matmuls), none. Memory is
torch.cuda's allocated bytes above what the weights and the input hold; time is the mean of 5 steps after 2.
Needs a GPU.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch
from one_pass_timing import write_result
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import atma_titan.models.layers as layers
from atma_titan.kernels.glu import glu
from atma_titan.models.atma import Block
from atma_titan.models.flavors import FLAVORS
from atma_titan.parallel.parallelize import selective_policy

GLU_PASS = layers.MLP.forward


def autograd_mlp(self, x):  # the MLP before the hand-written backward
    return self.proj(glu(self.fc(x), self.kind))


def wrapped(block, mode: str, d_model: int):
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=True)
    if mode == "none":
        return block
    policy = selective_policy(None if mode == "selective" else 4 * d_model)
    return checkpoint_wrapper(block, context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


def measure(mode: str, args, tokens: tuple[int, int]) -> dict:
    torch._dynamo.reset()
    blocks = [torch.compile(wrapped(Block(args, i).cuda().bfloat16(), mode, args.d_model), fullgraph=True)
              for i in range(8) if not args.is_global(i)][:4]  # fmt: skip
    x = torch.randn(*tokens, args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        h = x
        for block in blocks:
            h, _ = block(h)
        return h

    for _ in range(2):  # compile, then a step with the compiled code
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        h = step()
        held = torch.cuda.memory_allocated() - base
        h.float().sum().backward()
        peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        step().float().sum().backward()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / 5 * 1000
    return {"ms": ms, "held_after_forward_mib": held / 2**20, "peak_mib": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/mlp_ac_memory.py needs a GPU")
    flavor, tokens = FLAVORS["atma_370m"], (8, 2048)
    rows = []
    for mode in ("full", "selective", "narrow_matmuls", "none"):
        for name, forward in (("autograd backward", autograd_mlp), ("GLU pass", GLU_PASS)):
            layers.MLP.forward = forward
            row = {"ac": mode, "mlp": name, **measure(mode, flavor, tokens)}
            rows.append(row)
            print(f"{mode:15s} {name:18s} {row['ms']:7.2f} ms  held {row['held_after_forward_mib']:6.0f} MiB  "
                  f"peak {row['peak_mib']:6.0f} MiB", flush=True)  # fmt: skip
    layers.MLP.forward = GLU_PASS
    write_result(args.out, "mlp_ac_memory", {"tokens": tokens, "rows": rows})


if __name__ == "__main__":
    main()
