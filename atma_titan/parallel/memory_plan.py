"""Will it fit? The peak GPU memory of one rank's training step, estimated before anything is allocated.

    python -m atma_titan.train --config train_configs/atma_370m.toml --job.dry_run true --job.gpu l4

The peak is the sum of these parts, per rank, on the trainer's torchrun path (FSDP2, also on one rank):

- parameters: each rank's fp32 shard of every parameter (dim 0 cut in `dp_shard` pieces, padded to the first
  as FSDP2 pads them), and the bf16 copy FSDP2 gathers: all of it when `parallelism.reshard_after_forward`
  resolves to false (one rank), else the block running, the one prefetched and the head (FSDP2 frees a block
  after its forward, also one the last backward left gathered: `set_micro_batch`).
- gradients: while a step's micro-batches accumulate, FSDP2 keeps every gradient whole in fp32 (on every rank,
  however many), which a step of several micro-batches holds at its peak; a step of one micro-batch holds none
  then, and the fp32 shards in its optimizer step.
- optimizer state: Muon's fp32 momentum per block matrix, AdamW's two fp32 moments and step count per other
  parameter (`optim.container.split_parameters` decides which), on each rank's shards.
- activations: per block type, the tensors the compiled block keeps for its backward under the chosen
  activation checkpointing (`block_tensors`: the block input, norms, projections, the Polar and gated-delta
  kernels' outputs and workspaces, the MLP's up-projection), a size per token each from the shapes, times the
  micro-batch's tokens; on top, the larger of the fused LM-head loss at the end of forward (two chunks of
  `training.loss_chunk_mib` logits and the fp32 head gradient) and one block's backward (its gradient buffers
  and, under AC, what the recomputation holds by then).
- workspaces: what the allocator holds beyond those (compiled graphs, Triton, cuBLAS), the one constant fitted
  on the measured peaks; then, as the device counts, the allocator's reserve and the CUDA context (measured).

The first three are exact: counted on the model built on the meta device, as the optimizers group it
(tests/parallel/test_memory_plan.py checks them against the real optimizers' state after a step, on one rank and
on three gloo ranks). Which tensors a block keeps was read off single compiled 370M blocks measured on the H200
(benchmarks/train/memory_peaks.py; within 1.5% of every block type and AC mode). The estimated allocated peak
against torch.cuda.max_memory_allocated of the 370M at 2,048 tokens, one rank under torchrun, compiled, the
recipe's 524,288 tokens a step, on the H200 (docs/performance.md: the first six of 2026-12-04, the others of
2026-12-05):

    micro-batch, AC, micro-batches a step               measured   estimated   error
    16, selective in the global blocks (recipe), 16     23.8 GiB   23.8 GiB    -0.0%
    16, selective in every block, 16                    22.3 GiB   22.3 GiB    -0.1%
    16, none, 16                                        26.1 GiB   26.0 GiB    -0.4%
    16, selective in the global blocks, 1               22.4 GiB   22.4 GiB    -0.1%
    8, selective in the global blocks, 32 (L4 config)   15.2 GiB   15.2 GiB    +0.1%
    8, full in the global blocks, 32                    12.4 GiB   12.5 GiB    +0.4%
    32, selective in the global blocks, 8               41.7 GiB   41.6 GiB    -0.2%
    32, none, 8                                         46.2 GiB   46.0 GiB    -0.5%
    16, full in every block, 16                         10.0 GiB   10.0 GiB    +0.5%
    4, selective in every block, 64                     10.3 GiB   10.3 GiB    +0.3%

and the reserved peak and the device's memory within 0.5% in the last five (whose runs the reserve and the
context were fitted on). Not measured: other GPUs, several ranks, fp32 training, the plain loss, eager runs, the
reference kernels, the ablations' blocks (modelled from their shapes alike).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from atma_titan.config import ConfigError
from atma_titan.models.atma import ATMA
from atma_titan.models.flavors import ModelArgs
from atma_titan.models.loss import chunk_tokens_for
from atma_titan.optim.container import split_parameters
from atma_titan.optim.newton_schulz import MAX_BATCH_ELEMENTS, batch_shape
from atma_titan.parallel.dims import resolve_degrees
from atma_titan.parallel.parallelize import resolve_reshard_after_forward

GiB = 1 << 30
MiB = 1 << 20

# ---------------------------------------------------------------------------------------------
# GPUs, and what a process takes beyond the allocated peak


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    total: int  # bytes, the board's memory as nvidia-smi reports it

    def describe(self) -> str:
        return f"an {self.name} ({self.total / GiB:.1f} GiB)" if self.name[0] in "AHL" else f"a {self.name}"


GPUS = {  # nvidia-smi's totals, MiB
    "l4": Gpu("l4", "L4", 23_034 * MiB),
    "a100-40": Gpu("a100-40", "A100 40GB", 40_960 * MiB),
    "a100-80": Gpu("a100-80", "A100 80GB", 81_920 * MiB),
    "h100": Gpu("h100", "H100 80GB", 81_559 * MiB),
    "h200": Gpu("h200", "H200", 143_771 * MiB),
}

# Measured on the H200 (benchmarks/train/memory_peaks.py): what the driver keeps of the board (nvidia-smi's
# total less what cudaMemGetInfo offers: 0.60 GiB) and the process's CUDA context with its cuBLAS and NCCL
# handles (used less reserved while training: 0.90 GiB in every run).
DRIVER_BYTES = int(0.60 * GiB)
CONTEXT_BYTES = DRIVER_BYTES + int(0.90 * GiB)
# What the caching allocator holds beyond the allocated peak (max_memory_reserved - max_memory_allocated),
# fitted on five runs of 10-46 GiB on the H200 under expandable_segments:True (launch/train_local.sh sets it):
# 1.28 GiB + 2.2% of the allocated peak, within 0.04 GiB of each.
RESERVE_BYTES = int(1.28 * GiB)
RESERVE_FRACTION = 0.022
# In the allocator beyond parameters, gradients, optimizer state and activations (compiled graphs' buffers,
# Triton's autotuning, cuBLAS workspaces): the one constant fitted on the measured allocated peaks.
WORKSPACE_BYTES = int(0.11 * GiB)
# The verdict leaves this share of the board free: for what the estimate does not see (another process, a
# validation pass, fragmentation over a long run, another GPU's context).
HEADROOM = 0.03


def local_gpu() -> Gpu | None:
    """This machine's first CUDA device, matched to GPUS by name, else as it reports itself."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    words = set(re.split(r"[^A-Z0-9]+", props.name.upper()))
    for key in ("h200", "h100", "l4"):
        if key.upper() in words:
            return GPUS[key]
    if "A100" in words:
        return GPUS["a100-80" if props.total_memory > 60 * GiB else "a100-40"]
    return Gpu("local", props.name, props.total_memory + DRIVER_BYTES)


# ---------------------------------------------------------------------------------------------
# What a training step is planned for


@dataclass(frozen=True)
class Checkpointing:
    """[activation_checkpoint]: mode none | selective | full, every_n (full), save (selective), blocks."""

    mode: str = "none"
    every_n: int = 1
    save: str = "matmuls"
    blocks: str = "all"

    def wraps(self, index: int, is_global: bool) -> str:
        """The mode block `index` runs under: none, selective or full."""
        chosen = {"all": True, "global": is_global, "local": not is_global}[self.blocks]
        if self.mode == "none" or not chosen or (self.mode == "full" and index % self.every_n):
            return "none"
        return self.mode

    def describe(self) -> str:
        if self.mode == "none":
            return "no AC"
        where = {"all": "every block", "global": "the global blocks", "local": "the local blocks"}[self.blocks]
        if self.mode == "full":
            every = f" (every_n = {self.every_n})" if self.every_n > 1 else ""
            return f"full AC in {where}{every}"
        save = "" if self.save == "matmuls" else f" (save = {self.save})"
        return f"selective AC{save} in {where}"


@dataclass(frozen=True)
class Step:
    """One rank's training step as the plan sees it."""

    micro_batch: int
    seq_len: int
    accum: int  # micro-batches a step on each rank
    dp_shard: int
    dp_replicate: int
    reshard_after_forward: bool
    ac: Checkpointing
    compute_bytes: int = 2  # bf16 gathered parameters and activations; 4 under mixed_precision = fp32
    loss: str = "fused"
    loss_chunk_mib: float = 1024.0

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


def step_of(cfg, world_size: int) -> Step:
    """The Step of a JobConfig at `world_size` data-parallel ranks (the degrees as the trainer resolves them)."""
    p, t, a = cfg.parallelism, cfg.training, cfg.activation_checkpoint
    dp_replicate, dp_shard = resolve_degrees(world_size, p.dp_replicate, p.dp_shard)
    global_batch = t.batch_tokens // t.seq_len
    if global_batch % (t.micro_batch_size * world_size):  # as the trainer's BatchPlan refuses it
        raise ConfigError(
            f"'training.batch_tokens' = {t.batch_tokens} is {global_batch} sequences of {t.seq_len}, not a multiple "
            f"of training.micro_batch_size ({t.micro_batch_size}) x {world_size} rank{'s' if world_size > 1 else ''}"
        )
    accum = global_batch // (t.micro_batch_size * world_size)
    reshard = resolve_reshard_after_forward(p.reshard_after_forward, SimpleNamespace(dp_shard=dp_shard))
    return Step(
        micro_batch=t.micro_batch_size,
        seq_len=t.seq_len,
        accum=accum,
        dp_shard=dp_shard,
        dp_replicate=dp_replicate,
        reshard_after_forward=reshard,
        ac=Checkpointing(a.mode, a.every_n, a.selective_save, a.blocks),
        compute_bytes=2 if t.mixed_precision == "bf16" else 4,
        loss=t.loss,
        loss_chunk_mib=t.loss_chunk_mib,
    )


# ---------------------------------------------------------------------------------------------
# The exact part: parameters, gradients, optimizer state


def shard_numel(p: torch.Tensor, shards: int) -> int:
    """Elements of a rank's FSDP2 shard of `p`: dim 0 in `shards` pieces, each padded to the largest."""
    rows = p.shape[0] if p.dim() else 1
    return -(-rows // shards) * (p.numel() // max(rows, 1))


@dataclass(frozen=True)
class States:
    """Bytes per rank of the training state (exact)."""

    params: int  # fp32 shards
    gathered: int  # the compute-dtype copy FSDP2 gathers, as held at the activation peak
    gathered_whole: int  # all of it: between micro-batches, after a backward that kept its blocks gathered
    grads_accumulated: int  # whole fp32 gradients held while micro-batches accumulate
    grads_sharded: int  # fp32 gradient shards after the step's last backward
    muon: int  # momentum buffers
    adamw: int  # exp_avg, exp_avg_sq and step

    @property
    def optimizer(self) -> int:
        return self.muon + self.adamw


def optimizer_state_bytes(model: torch.nn.Module, optimizer_name: str, shards: int = 1) -> tuple[int, int]:
    """(Muon, AdamW) state bytes per rank: one fp32 momentum per Muon matrix; two fp32 moments and an fp32 step
    count per AdamW parameter (torch.optim.AdamW's state: its step is a 0-d tensor, fused or not)."""
    groups = split_parameters(model)
    matrices = groups["matrix"] if optimizer_name == "muon_adamw" else []
    adam = [p for name in ("embed", "head", "scalar") for p in groups[name]]
    if optimizer_name != "muon_adamw":
        adam += groups["matrix"]
    muon = sum(4 * shard_numel(p, shards) for p in matrices)
    adamw = sum(8 * shard_numel(p, shards) + 4 for p in adam)
    return muon, adamw


def gathers_all(step: Step) -> bool:
    """Whether every block stays gathered through forward and backward (reshard_after_forward off). Otherwise
    FSDP2 frees each block after its forward, also a block that the last backward left gathered."""
    return not step.reshard_after_forward


def state_bytes(model: ATMA, optimizer_name: str, step: Step) -> States:
    params = [p for p in model.parameters() if p.requires_grad]
    shards = step.dp_shard
    local = sum(shard_numel(p, shards) for p in params)
    padded_whole = sum(shard_numel(p, shards) * shards for p in params)
    if gathers_all(step):
        gathered = padded_whole
    else:  # two blocks at a time (the one running and the one prefetched), the head kept gathered
        blocks = sorted((sum(p.numel() for p in b.parameters()) for b in model.blocks.values()), reverse=True)
        head = sum(p.numel() for p in (*model.norm.parameters(), *model.head.parameters()))
        gathered = sum(blocks[:2]) + head
    muon, adamw = optimizer_state_bytes(model, optimizer_name, shards)
    return States(
        params=4 * local,
        gathered=step.compute_bytes * gathered,
        gathered_whole=step.compute_bytes * padded_whole,
        grads_accumulated=4 * sum(p.numel() for p in params) if step.accum > 1 else 0,
        grads_sharded=4 * local,
        muon=muon,
        adamw=adamw,
    )


# ---------------------------------------------------------------------------------------------
# The activations: what each compiled block keeps for its backward, per token


@dataclass(frozen=True)
class Tensor:
    """One activation of a block, in bytes per token.

    kept: why selective AC keeps it ("input": the block's input; "kernel": a fused kernel's output; "matmul":
    a matmul's output, `width` wide; "function": the output of an autograd.Function, whose inside a compiled
    checkpoint does not recompute, so full AC keeps it too; "": recomputed). no_ac: whether the block keeps
    it without AC (the matmul outputs that only the recomputation reads are kept by the selective policy
    alone). part: "mixer" or "mlp", the half of the block whose backward reads it."""

    name: str
    bytes: float
    kept: str = ""
    width: int = 0
    no_ac: bool = True
    part: str = "mixer"
    flops: float = 0  # a matmul's forward FLOPs per token: what recomputing it costs


GATED_DELTA_CHUNK = 64  # kernels/gated_delta/triton_chunked.CHUNK (importing that module needs triton)


def gated_delta_workspace_bytes(args: ModelArgs, seq_len: int, a: int) -> float:
    """Per token: the workspaces the Triton gated-delta forward keeps for its backward (triton_chunked.WORKSPACES
    over the sequence padded to whole chunks: g in fp32; the chunk inverse, w, u_tilde, u and every chunk's start
    state in the dot dtype, a bytes)."""
    c, h, dk, dv = GATED_DELTA_CHUNK, args.n_heads, args.head_dim, args.head_dim
    chunks = -(-seq_len // c)
    return h * chunks * (c * (4 + a * (c + dk + 2 * dv)) + a * dv * dk) / seq_len


def block_tensors(args: ModelArgs, is_global: bool, seq_len: int, a: int = 2) -> list[Tensor]:
    """The activations one compiled block holds for its backward, a bytes per activation element (2: bf16)."""
    d, f = args.d_model, args.mlp_hidden
    out = [Tensor("block input", a * d, "input"), Tensor("norm1 rstd", 4), Tensor("norm1 output", a * d)]
    if is_global:
        h, hkv, dh = args.n_heads, args.n_kv_heads, args.head_dim
        e, ekv = h * dh, hkv * dh
        width = 2 * e + 2 * ekv + (2 * h + e if args.memory else 0)  # [q | gate], k, v (+ gamma, beta, gate)
        out += [
            Tensor("q, gate, k, v (+ memory) projections", a * width, "matmul", width, flops=2 * d * width),
            Tensor("q, k RMS-normed", a * (e + ekv) + 4 * (h + hkv)),
            Tensor("output gate, sigmoid", a * e),
        ]
        if args.canon:
            out.append(Tensor("q, k, v after Canon", a * (e + 2 * ekv)))
        if args.attention == "polar":
            out += [
                Tensor("Polar direction and count", a * (e + h) + 12 * h, "kernel"),
                Tensor("o_proj input", a * e),
                Tensor("o_proj, mu_proj outputs", 2 * a * d, "matmul", d, no_ac=False, flops=2 * (e + h) * d),
            ]
        else:  # SDPA: its output and log-sum-exp; k, v repeated to every query head
            out += [
                Tensor("attention output", a * e + 4 * h, "kernel"),
                Tensor("k, v repeated to the query heads", 2 * a * e if h > hkv else 0),
                Tensor("o_proj input", a * e),
                Tensor("o_proj output", a * d, "matmul", d, no_ac=False, flops=2 * e * d),
            ]
        if args.memory:
            out += [
                Tensor("k, v repeated for the memory", 2 * a * e if h > hkv else 0),
                Tensor("log gamma, beta", 8 * h),
                Tensor("memory readout", a * e, "kernel"),
                Tensor("memory kernel workspaces", gated_delta_workspace_bytes(args, seq_len, a), "kernel"),
                Tensor("readout RMS-normed", a * e + 4 * h),
                Tensor("memory proj input", a * e),
                Tensor("memory proj output", a * d, "matmul", d, no_ac=False, flops=2 * e * d),
            ]
    else:
        out += [
            Tensor("in_proj output", 3 * a * d, "matmul", 3 * d, flops=6 * d * d),
            Tensor("gated conv output", a * d, "function", no_ac=False),
        ]
    out += [
        Tensor("residual after the mixer", a * d),
        Tensor("norm2 rstd", 4, part="mlp"),
        Tensor("norm2 output", a * d, part="mlp"),
        Tensor("MLP fc output", 2 * a * f, "matmul", 2 * f, part="mlp", flops=4 * d * f),
    ]
    return out


def saved_width(args: ModelArgs, save: str) -> float:
    """The widest matmul output selective AC keeps under selective_save `save` (parallelize.py's policy)."""
    return {"matmuls": math.inf, "narrow_matmuls": 4 * args.d_model, "kernels": 0}[save]


@dataclass(frozen=True)
class BlockMemory:
    """Per token: kept from forward to backward, and the most alive at once in the block's backward above that
    (the gradient entering the block included)."""

    saved: float
    backward: float


def block_memory(args: ModelArgs, is_global: bool, mode: str, save: str, seq_len: int, a: int = 2) -> BlockMemory:
    """One compiled block under AC `mode` (none | selective | full) with selective_save `save`.

    Its backward runs the MLP's half, then the mixer's. Each half's peak is its gradient buffers (the MLP's: dh,
    the GLU's du and its recomputed output, 4 x mlp_hidden elements; the memory kernel's fp32 buffers and the
    q, k, v gradients of every head; the conv's) and what recomputation has brought back by then: under full
    AC, the MLP's inputs, and, when the mixer's output was not kept, the whole forward (its residual output is
    the MLP's input); under selective AC, the MLP's when its fc output was not kept (the measured peaks show no
    more: the compiled backward recomputes the rest where it is read)."""
    tensors = block_tensors(args, is_global, seq_len, a)
    if mode == "selective":
        limit = saved_width(args, save)

        def keeps(t: Tensor) -> bool:
            return t.kept in ("input", "kernel", "function") or (t.kept == "matmul" and t.width <= limit)

    elif mode == "full":

        def keeps(t: Tensor) -> bool:
            return t.kept in ("input", "function")

    else:

        def keeps(t: Tensor) -> bool:
            return t.no_ac

    saved = sum(t.bytes for t in tensors if keeps(t))
    lost = [t for t in tensors if t.no_ac and not keeps(t)]  # what the backward must recompute
    mlp_lost = sum(t.bytes for t in lost if t.part == "mlp")
    mixer_lost = sum(t.bytes for t in lost if t.part == "mixer")
    mixer_kept_output = any(t.kept == "function" for t in tensors)
    if mode == "full":
        mlp_live = mlp_lost + (0 if mixer_kept_output else mixer_lost)
        mixer_live = mixer_lost
    else:  # the fc output recomputed (selective_save without it): the GLU's backward needs it and its input
        fc_lost = any(t.part == "mlp" and t.kept == "matmul" for t in lost)
        mlp_live, mixer_live = (sum(t.bytes for t in tensors if t.part == "mlp") if fc_lost else 0), 0
    d, e = args.d_model, args.n_heads * args.head_dim
    mlp_grads = 4 * a * args.mlp_hidden
    if is_global:  # the memory kernel's du_local, du, dk_partial (fp32), and dq, dk, dv for every query head
        mixer_grads = (12 * e + 3 * a * e) if args.memory else 3 * a * e
    else:  # the conv's do, du and o
        mixer_grads = 5 * a * d
    backward = max(mlp_live + mlp_grads, mixer_live + mixer_grads)
    return BlockMemory(saved, backward + a * d)


@dataclass(frozen=True)
class Activations:
    saved: int  # bytes kept from forward to backward at the end of forward (every block, the head)
    peak: int  # the most alive at once (>= saved)
    where: str  # what is running at the peak


def head_memory(args: ModelArgs, step: Step) -> tuple[float, int, int]:
    """(per token kept for backward, bytes kept for backward, the most alive at once above those while the head's
    forward runs) of the final norm and the LM head with its loss."""
    a, d, v, tokens = step.compute_bytes, args.d_model, args.vocab_size, step.tokens
    if step.loss == "fused":
        # Kept: the final norm's input and rstd, and the fused loss's gradients w.r.t. the hidden states, the weight
        # and the bias (in their dtype). Running: the fp32 weight gradient it adds up (its bf16 copy comes last),
        # and two chunks' logits with their product with the weight (a chunk's result lives on while the next
        # chunk is computed). Measured on the H200 at 32K tokens: 1,199.2 MB, this 1,198.6 MB.
        chunk = min(chunk_tokens_for(v, step.loss_chunk_mib), tokens)
        live = chunk + min(chunk, tokens - chunk)
        running = (4 - a) * v * d + live * a * (v + d)
        return a * d + 4 + a * d, a * (v * d + v), running
    # Plain: the fp32 (soft-capped) logits are kept, and the cross-entropy makes two more of their size.
    return a * d + 4 + a * d + 4 * v, 0, 2 * 4 * v * tokens


def activation_bytes(args: ModelArgs, step: Step) -> Activations:
    """Activations of one micro-batch: every block's kept tensors, the head's, and the peak above them (the loss at
    the end of forward, or a block's backward, whichever is larger)."""
    tokens, a = step.tokens, step.compute_bytes
    per_block = []
    for i in range(args.n_layers):
        g = args.is_global(i)
        per_block.append(block_memory(args, g, step.ac.wraps(i, g), step.ac.save, step.seq_len, a))
    head_per_token, head_fixed, head_running = head_memory(args, step)
    kept = [b.saved * tokens for b in per_block]
    saved = sum(kept) + head_per_token * tokens + head_fixed
    peak, where = saved + head_running, "the LM head's loss at the end of forward"
    below = 0.0  # blocks before block i
    for i, (b, k) in enumerate(zip(per_block, kept)):
        at = below + k + b.backward * tokens
        if at > peak:
            peak, where = at, f"the backward of block {i}"
        below += k
    return Activations(int(saved), int(peak), where)


# ---------------------------------------------------------------------------------------------
# The plan


def largest_newton_schulz_batch(model: ATMA, shards: int) -> int:
    """Elements of the largest stack of same-shape matrices Muon orthogonalises at once on a rank (UpdateBatches:
    at most MAX_BATCH_ELEMENTS; under FSDP a rank orthogonalises the ~1/shards matrices it owns)."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for p in split_parameters(model)["matrix"]:
        by_shape.setdefault(batch_shape(tuple(p.shape)), []).append(p.numel())
    largest = 0
    for (rows, cols), sizes in by_shape.items():
        count = -(-len(sizes) // shards)  # owned by the busiest rank, about
        per_batch = max(1, MAX_BATCH_ELEMENTS // (rows * cols))
        largest = max(largest, min(count, per_batch) * rows * cols)
    return largest


@dataclass(frozen=True)
class Plan:
    step: Step
    states: States
    activations: Activations
    newton_schulz: int = 0  # elements of Muon's largest batch
    workspace: int = WORKSPACE_BYTES

    @property
    def gradients(self) -> int:
        """Held at the activation peak: the accumulated whole gradients (none in a one-micro-batch step)."""
        return self.states.grads_accumulated

    @property
    def training_peak(self) -> int:
        s = self.states
        return s.params + s.gathered + self.gradients + s.optimizer + self.activations.peak + self.workspace

    @property
    def between_micro_batches(self) -> int:
        """A step of several micro-batches: after a backward that kept its blocks gathered (set_micro_batch), the
        whole gathered copy and the accumulated gradients, before the next forward frees the blocks again."""
        s = self.states
        return s.params + s.gathered_whole + self.gradients + s.optimizer + self.workspace if self.step.accum > 1 else 0

    @property
    def optimizer_peak(self) -> int:
        """The optimizer step: parameter and gradient shards, the state, Muon's bf16 updates (half the momenta's
        bytes) and the Newton-Schulz products of its largest batch (three bf16 copies of it). Not calibrated: the
        activation peak was the larger in every measured run."""
        s = self.states
        return s.params + s.grads_sharded + s.optimizer + s.muon // 2 + 6 * self.newton_schulz + self.workspace

    @property
    def allocated(self) -> int:
        """The estimated torch.cuda.max_memory_allocated of a step."""
        return max(self.training_peak, self.between_micro_batches, self.optimizer_peak)

    @property
    def reserve(self) -> int:
        """What the allocator holds beyond the allocated peak (torch.cuda.max_memory_reserved - max_allocated)."""
        return RESERVE_BYTES + int(RESERVE_FRACTION * self.allocated)

    @property
    def device(self) -> int:
        """What the process takes of the board, as nvidia-smi counts it (with the driver's own reserve)."""
        return self.allocated + self.reserve + CONTEXT_BYTES

    def rows(self) -> list[tuple[str, int, str]]:
        s, act, step = self.states, self.activations, self.step
        grads = (
            "whole, accumulated over the micro-batches"
            if step.accum > 1
            else f"none at the activation peak ({gib(s.grads_sharded)} of shards in the optimizer step)"
        )
        dtype = "bf16" if step.compute_bytes == 2 else "fp32"
        gathered = "all of them" if gathers_all(step) else "two blocks and the head at a time"
        return [
            ("parameters, fp32 shards", s.params, ""),
            (f"parameters, {dtype} gathered", s.gathered, gathered),
            ("gradients, fp32", self.gradients, grads),
            ("optimizer state", s.optimizer, f"Muon {gib(s.muon)}, AdamW {gib(s.adamw)}"),
            ("activations", act.peak, f"kept {gib(act.saved)}; peak in {act.where}"),
            ("workspaces", self.workspace, "compiled graphs, Triton, cuBLAS"),
            ("peak allocated", self.allocated, "torch.cuda.max_memory_allocated"),
            ("allocator reserve", self.reserve, "reserved beyond allocated"),
            ("CUDA context, driver", CONTEXT_BYTES, ""),
            ("on the device", self.device, "as nvidia-smi counts it"),
        ]


def plan_memory(model: ATMA, optimizer_name: str, step: Step) -> Plan:
    """The plan of `step` for `model` (built on the meta device)."""
    newton_schulz = largest_newton_schulz_batch(model, step.dp_shard) if optimizer_name == "muon_adamw" else 0
    return Plan(step, state_bytes(model, optimizer_name, step), activation_bytes(model.args, step), newton_schulz)


# ---------------------------------------------------------------------------------------------
# What fits, and which of that is fastest

# A step's time grows by this factor each time the micro-batch halves below 32K tokens: measured on the H200,
# 216,880 tokens/s at 16 x 2,048 against 178,980 at 8 x 2,048 (docs/performance.md, 2026-12-04). Larger
# micro-batches ran no faster. A slower GPU (an L4) is less held up by the host at small micro-batches.
MICRO_BATCH_COST = 1.21
FULL_SPEED_TOKENS = 32_768


def recompute_share(model: ATMA, step: Step) -> float:
    """The matmul FLOPs that AC recomputes, as a share of a step's forward and backward matmul FLOPs (6 x the
    matrix parameters of the blocks and the head, per token): a full block repeats its forward (2 x its matrix
    parameters), selective AC the matmuls wider than it keeps. Attention's own FLOPs are left out."""
    args, total, repeated = model.args, 0.0, 0.0
    for i, block in enumerate(model.blocks.values()):
        forward = 2 * sum(p.numel() for p in block.parameters() if p.dim() >= 2)
        total += 3 * forward
        mode = step.ac.wraps(i, block.is_global)
        if mode == "full":
            repeated += forward
        elif mode == "selective":
            limit = saved_width(args, step.ac.save)
            tensors = block_tensors(args, block.is_global, step.seq_len, step.compute_bytes)
            repeated += sum(t.flops for t in tensors if t.kept == "matmul" and t.width > limit)
    total += 6 * model.head.weight.numel()
    return repeated / total


def relative_time(model: ATMA, step: Step) -> float:
    """A step's time relative to the same step at micro-batches of 32K tokens without recomputation (a guide
    for choosing among settings that fit, from the FLOPs and the H200's measured cost of small micro-batches)."""
    halvings = max(0.0, math.log2(FULL_SPEED_TOKENS / step.tokens))
    return (1 + recompute_share(model, step)) * MICRO_BATCH_COST**halvings


# The AC settings tried for advice, least recomputation first.
AC_CHOICES = (
    Checkpointing("none"),
    Checkpointing("selective", blocks="global"),
    Checkpointing("selective", blocks="all"),
    Checkpointing("full", blocks="global"),
    Checkpointing("full", blocks="all"),
)


@dataclass(frozen=True)
class Budget:
    """What a step may take: the board (compared with Plan.device), or debug.memory_cap_gib, which caps the
    allocator's reserve (compared with allocated + reserve; the context is outside the cap)."""

    gpu: Gpu
    cap_gib: float = 0.0

    def need(self, plan: Plan) -> int:
        return plan.allocated + plan.reserve if self.cap_gib > 0 else plan.device

    def limit(self) -> int:
        board = int(self.gpu.total * (1 - HEADROOM))
        return min(int(self.cap_gib * GiB), board - CONTEXT_BYTES) if self.cap_gib > 0 else board

    def fits(self, plan: Plan) -> bool:
        return self.need(plan) <= self.limit()

    def describe(self) -> str:
        cap = f" capped at {self.cap_gib:g} GiB (debug.memory_cap_gib)" if self.cap_gib > 0 else ""
        return f"{self.gpu.describe()}{cap}"


def micro_batches(step: Step) -> list[int]:
    """The config's micro-batch and its halvings, those that divide the rank's sequences a step."""
    per_rank = step.micro_batch * step.accum
    out, mb = [], step.micro_batch
    while mb >= 1:
        if per_rank % mb == 0:
            out.append(mb)
        if mb % 2:
            break
        mb //= 2
    return out


def advice(model: ATMA, optimizer_name: str, step: Step, budget: Budget) -> Plan | None:
    """Among the config's micro-batch and its halvings, under the config's AC and AC_CHOICES, the setting that fits
    with the least estimated step time (relative_time); on a tie the config's own, then the larger micro-batch
    and the less recomputation."""
    per_rank = step.micro_batch * step.accum
    choices = [step.ac, *(c for c in AC_CHOICES if c != step.ac)]
    best, best_key = None, None
    for mb in micro_batches(step):
        for rank, ac in enumerate(choices):
            candidate = plan_memory(model, optimizer_name, replace(step, micro_batch=mb, accum=per_rank // mb, ac=ac))
            if not budget.fits(candidate):
                continue
            own = candidate.step == step
            order = AC_CHOICES.index(ac) if ac in AC_CHOICES else rank
            key = (round(relative_time(model, candidate.step), 3), not own, -mb, order)
            if best_key is None or key < best_key:
                best, best_key = candidate, key
    return best


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def verdict(model: ATMA, optimizer_name: str, plan: Plan, budget: Budget) -> str:
    """One line: whether the step fits the budget, and the fastest setting that fits when it is not the config's."""
    line = f"fits on {budget.describe()}: {'yes' if budget.fits(plan) else 'no'} (estimated {gib(budget.need(plan))})"
    better = advice(model, optimizer_name, plan.step, budget)
    if better is None:
        return line + "; nothing fits, not even micro-batch 1 with full AC: shard over more ranks or take a larger GPU"
    if better.step != plan.step:
        mb, ac = better.step.micro_batch, better.step.ac.describe()
        line += f"; fastest that fits: micro-batch {mb} with {ac}, {gib(budget.need(better))}"
    return line


def plan_lines(model: ATMA, optimizer_name: str, step: Step, budgets: list[Budget], ranks_note: str) -> list[str]:
    """The dry run's memory table, and for each budget whether the step fits and what would."""
    plan = plan_memory(model, optimizer_name, step)
    ranks = step.dp_shard * step.dp_replicate
    layout = f"dp_shard {step.dp_shard}" + (f" x dp_replicate {step.dp_replicate}" if step.dp_replicate > 1 else "")
    lines = [
        f"memory per rank: {ranks} rank{'s' if ranks > 1 else ''} ({layout}; {ranks_note}), micro-batch "
        f"{step.micro_batch} x {step.seq_len:,} ({step.accum} a step), {step.ac.describe()}",
        f"  {'':<25} {'GiB':>7}",
    ]
    for name, n, note in plan.rows():
        lines.append(f"  {name:<25} {n / GiB:>7.2f}" + (f"   {note}" if note else ""))
    lines += [verdict(model, optimizer_name, plan, b) for b in budgets]
    return lines


def print_memory_plan(cfg, args: ModelArgs, world_size: int | None) -> None:
    """The dry run's memory plan: at `world_size` ranks (None: job.plan_world_size, else torchrun's WORLD_SIZE,
    else 1), on job.gpu (auto: this machine's GPU, else every GPU in GPUS)."""
    if cfg.job.plan_world_size < 0:
        raise ConfigError(f"'job.plan_world_size' = {cfg.job.plan_world_size} is invalid; allowed: 0 or a rank count")
    if cfg.job.plan_world_size > 0:
        ranks, note = cfg.job.plan_world_size, "job.plan_world_size"
    elif world_size is not None:
        ranks, note = world_size, "torchrun's WORLD_SIZE"
    else:
        ranks, note = 1, "no WORLD_SIZE: job.plan_world_size sets another"
    step = step_of(cfg, ranks)
    if cfg.job.gpu == "all":
        gpus = list(GPUS.values())
    elif cfg.job.gpu == "auto":
        here = local_gpu()
        gpus = [here] if here is not None else list(GPUS.values())
    else:
        gpus = [GPUS[cfg.job.gpu]]
    with torch.device("meta"):
        model = ATMA(args)
    budgets = [Budget(gpu, cfg.debug.memory_cap_gib) for gpu in gpus]
    for line in plan_lines(model, cfg.optimizer.name, step, budgets, note):
        print(line)
    if not cfg.training.compile:  # the kept tensors are those of compiled blocks (measured so)
        print("  training.compile = false: an eager step keeps more activations than this plan of compiled blocks")
