"""Generation with a cache: prefill, batched decode steps (CUDA graphs on the GPU), continuous batching.

    engine = Generator(model, max_batch=8, max_context=4096, eot_id=tokenizer.eot_id)
    for event in engine.generate([Request(prompt_ids, max_new_tokens=64)]):
        print(event.index, event.token, event.finished)

- **Prefill** runs a prompt through the trunk in chunks of `prefill_chunk` tokens with the fused
  kernels, writing its keys and values into pages and leaving its conv and memory states in its slot.
- **Decode** feeds one token per running sequence through every block (paged Polar decode kernel,
  in-place gated-delta step). On CUDA the whole step is captured in a CUDA graph per batch-size bucket
  (1, 2, 4, ...): the bucket's padding rows use the scratch slot and page.
- **Scheduling**: prompts wait in order; one is admitted when a slot and the pages for its prompt and
  new tokens are free, so a running sequence never runs out of cache. A sequence finishes at EOT or
  after max_new_tokens and frees its slot and pages for the next prompt.
- `use_cache=False` recomputes the full forward for every token instead (slow; for checking).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from atma_titan.utils.errors import InputError
from atma_titan.inference.cache import SCRATCH, ModelCache, SequenceAllocation
from atma_titan.inference.sampling import Sampling, sample
from atma_titan.models import ATMA

__all__ = ["Event", "Generator", "Request", "cast_for_inference"]


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    index: int = 0  # the caller's number for it; events carry it
    # stop(generated tokens) after each new token: True finishes the sequence ("stop"), e.g. at a stop string
    stop: Callable[[list[int]], bool] | None = None


@dataclass(frozen=True)
class Event:
    """One new token of request `index`; `finished` is "eot", "length" or "stop" on its last token, else None."""

    index: int
    token: int
    finished: str | None
    logits: torch.Tensor | None = None  # (V,) on the CPU, with Generator(record_logits=True)


@dataclass
class _Sequence:
    request: Request
    allocation: SequenceAllocation | None = None
    generated: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose keys and states are cached
    finished: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt + self.generated


def cast_for_inference(model: ATMA, dtype: torch.dtype) -> ATMA:
    """Store the Linear weights (every matmul operand, the LM head included) in `dtype`.

    The embedding, norms, conv taps and per-head Polar scalars stay fp32: with bf16 autocast around the
    forward this computes what training computes (autocast casts the same weights to bf16 there),
    without re-casting 370M weights on every token.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.to(dtype)
    return model


def _buckets(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class Generator:
    """Generate from `model` (unsharded, on one device, loaded) for many requests at once; see the module doc.

    max_batch sequences run at once; each may hold up to max_context tokens (prompt + new tokens);
    num_pages bounds the pool (default: max_batch full-length sequences). cuda_graphs: capture the
    decode step on CUDA (ignored on the CPU). compile: torch.compile the decode step (a compile per
    batch-size bucket, about a minute each for the 370M model; several times faster steps at small
    batch). record_logits: events carry the logits they were sampled from.
    """

    def __init__(
        self,
        model: ATMA,
        *,
        max_batch: int = 8,
        max_context: int = 4096,
        page_size: int = 16,
        num_pages: int | None = None,
        prefill_chunk: int = 2048,
        eot_id: int | None = None,
        sampling: Sampling = Sampling(),
        seed: int = 0,
        use_cache: bool = True,
        cuda_graphs: bool = True,
        compile: bool = False,
        record_logits: bool = False,
    ):
        if max_batch < 1:
            raise InputError(f"--batch-size {max_batch} is invalid; allowed: an integer >= 1")
        if prefill_chunk < 1:
            raise InputError(f"prefill_chunk {prefill_chunk} is invalid; allowed: an integer >= 1")
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.eot_id = eot_id
        self.sampling = sampling
        self.use_cache = use_cache
        self.record_logits = record_logits
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.on_cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.on_cuda else torch.float32
        self.cache = (
            ModelCache(
                model.args,
                max_seqs=max_batch,
                max_context=max_context,
                page_size=page_size,
                num_pages=num_pages,
                dtype=self.dtype,
                device=self.device,
            )  # fmt: skip
            if use_cache
            else None
        )
        self.cuda_graphs = cuda_graphs and self.on_cuda and use_cache
        # torch.compile fuses the step's ~800 small elementwise kernels (at batch 1 their launches, even
        # from a CUDA graph, are most of the step); one compiled graph per batch-size bucket
        self._step = torch.compile(self._decode_step, dynamic=False) if compile else self._decode_step
        self._graphs: dict[int, tuple] = {}
        self._graph_pool = None

    # -- one forward -----------------------------------------------------------------------------

    def _autocast(self):
        if not self.on_cuda:
            return contextlib.nullcontext()
        # no weight-cast cache: it does not survive CUDA-graph capture (and the weights are bf16 already)
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)

    @torch.no_grad()
    def prefill(self, tokens: list[int], slot: int) -> torch.Tensor:
        """Run a prompt into `slot` (its pages allocated); returns the logits (V,) after its last token."""
        for start in range(0, len(tokens), self.prefill_chunk):
            end = min(start + self.prefill_chunk, len(tokens))
            chunk = torch.tensor(tokens[start:end], device=self.device)[None]
            with self._autocast():
                h, _ = self.model.trunk(chunk, self.cache.prefill(slot, start, end))
        with self._autocast():
            return self.model.head(h[:, -1])[0]

    def _decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """tokens, positions, slots (B,) on the device -> logits (B, V): one token through every block."""
        with self._autocast():
            h, _ = self.model.trunk(tokens[:, None], self.cache.decode(slots, positions))
            return self.model.head(h[:, 0])

    @torch.no_grad()
    def decode(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """One token for each of B sequences (its slot, the token's position) -> logits (B, V).

        With CUDA graphs the returned logits are the graph's output buffer: read them before the next call.
        """
        b = len(tokens)
        if not self.cuda_graphs:
            return self._step(*torch.tensor([tokens, positions, slots], device=self.device))
        bucket = next(size for size in _buckets(self.max_batch) if size >= b)
        graph, host, copied, static_inputs, static_logits = self._graph(bucket)
        # The padded rows (token 0 at position 0 of the scratch slot) go up in one pinned, asynchronous
        # copy: the host does not wait for the previous step, only for this buffer's previous copy.
        copied.synchronize()
        host.fill_(SCRATCH)
        host[:, :b] = torch.tensor([tokens, positions, slots])
        static_inputs.copy_(host, non_blocking=True)
        copied.record()
        graph.replay()
        return static_logits[:b]

    def _graph(self, bucket: int):
        """The decode step captured for `bucket` sequences (made on first use), its pinned input buffer
        and the event of that buffer's last copy."""
        if bucket not in self._graphs:
            static_inputs = torch.zeros(3, bucket, dtype=torch.long, device=self.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up (Triton compiles and tunes here) on scratch rows only
                for _ in range(2):
                    self._step(*static_inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                static_logits = self._step(*static_inputs)
            self._graph_pool = graph.pool()
            host = torch.zeros(3, bucket, dtype=torch.long).pin_memory()
            copied = torch.cuda.Event()
            copied.record()
            self._graphs[bucket] = (graph, host, copied, static_inputs, static_logits)
        return self._graphs[bucket]

    @torch.no_grad()
    def full_forward(self, tokens: list[int]) -> torch.Tensor:
        """The logits (V,) after `tokens`, recomputed from scratch (the --no-cache path)."""
        with self._autocast():
            h, _ = self.model.trunk(torch.tensor(tokens, device=self.device)[None])
            return self.model.head(h[:, -1])[0]

    # -- scheduling -----------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise InputError for a request that can never run."""
        if not request.prompt:
            raise InputError(f"prompt {request.index} has no tokens")
        if request.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens {request.max_new_tokens} is invalid; allowed: an integer >= 1")
        vocab = self.model.args.vocab_size
        if not all(0 <= t < vocab for t in request.prompt):
            raise InputError(f"prompt {request.index} holds token ids outside the model's vocabulary (0..{vocab - 1})")
        if self.cache is not None:
            need = len(request.prompt) + request.max_new_tokens
            self.cache.check_fits(
                need, f"prompt {request.index} ({len(request.prompt):,} tokens + {request.max_new_tokens:,} new)"
            )

    def generate(self, requests: Iterable[Request]) -> Iterator[Event]:
        """Events (one per new token) for all requests, at most max_batch running at once."""
        waiting = deque(requests)
        for request in waiting:  # every error before the first token
            self.check(request)
        running: list[_Sequence] = []
        while waiting or running:
            while waiting and len(running) < self.max_batch and self._can_admit(waiting[0]):
                seq = self._admit(waiting.popleft())
                yield from self._advance([seq], self._first_logits(seq)[None])
                if not seq.finished:
                    running.append(seq)
            if running:
                yield from self._advance(running, self._next_logits(running))
                running = [seq for seq in running if not seq.finished]

    def _can_admit(self, request: Request) -> bool:
        return self.cache is None or self.cache.can_admit(len(request.prompt) + request.max_new_tokens)

    def _admit(self, request: Request) -> _Sequence:
        seq = _Sequence(request)
        if self.cache is not None:
            seq.allocation = self.cache.admit(len(request.prompt) + request.max_new_tokens)
        return seq

    def _first_logits(self, seq: _Sequence) -> torch.Tensor:
        seq.length = len(seq.request.prompt)
        if self.cache is None:
            return self.full_forward(seq.tokens)
        return self.prefill(seq.request.prompt, seq.allocation.slot)

    def _next_logits(self, running: list[_Sequence]) -> torch.Tensor:
        """Feed each running sequence its last token."""
        if self.cache is None:
            logits = torch.stack([self.full_forward(seq.tokens) for seq in running])
        else:
            tokens = [seq.generated[-1] for seq in running]
            positions = [seq.length for seq in running]
            logits = self.decode(tokens, positions, [seq.allocation.slot for seq in running])
        for seq in running:
            seq.length += 1
        return logits

    def _advance(self, seqs: list[_Sequence], logits: torch.Tensor) -> Iterator[Event]:
        tokens = sample(logits, self.sampling, self.generator).tolist()
        kept = logits.float().cpu() if self.record_logits else None
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.generated.append(token)
            if self.eot_id is not None and token == self.eot_id:
                seq.finished = "eot"
            elif len(seq.generated) >= seq.request.max_new_tokens:
                seq.finished = "length"
            elif seq.request.stop is not None and seq.request.stop(seq.generated):
                seq.finished = "stop"
            if seq.finished and seq.allocation is not None:
                self.cache.release(seq.allocation)
            yield Event(seq.request.index, token, seq.finished, None if kept is None else kept[row])
