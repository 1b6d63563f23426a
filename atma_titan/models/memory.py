"""Gated-delta ("Titans") recurrent memory of the global blocks (docs/model.md section 4).

One (dv x dk) state per query head, written from the block's post-Canon k, v and read with its q:

    M_t = gamma_t M_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,   r_t = M_t q_t
    memory = proj(rms_norm(r) * sigmoid(gate(x)))

with gamma_t = gamma_max * sigmoid(W_gamma x + 3.9) (retention ~0.98 at init) and
beta_t = sigmoid(W_beta x). q and k are L2-normalised inside the kernel, so every step contracts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from atma_titan.kernels.gated_delta import gated_delta, gated_delta_step_
from atma_titan.models.flavors import ModelArgs
from atma_titan.models.layers import rms_norm

RETENTION_OFFSET = 3.9  # sigmoid(3.9) ~ 0.98: a half-life of ~35 tokens before training


class GatedDeltaMemory(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        self.log_gamma_max = math.log(args.gamma_max)
        self.chunk = args.memory_chunk
        self.impl = args.memory_impl
        inner = args.n_heads * args.head_dim
        self.gamma_proj = nn.Linear(args.d_model, args.n_heads)
        self.beta_proj = nn.Linear(args.d_model, args.n_heads)
        self.gate = nn.Linear(args.d_model, inner)
        self.proj = nn.Linear(inner, args.d_model)

    def input_projections(self) -> list[nn.Linear]:
        """The projections of the block input x that forward() takes, in its order: the global block
        computes them in one matrix product with its q, k and v (layers.fused_linear)."""
        return [self.gamma_proj, self.beta_proj, self.gate]

    def forward(self, projected, q, k, v, cache=None, doc_start=None) -> torch.Tensor:
        """projected: input_projections() of the block input, each (B, T, width); q: (B, T, H, dk);
        k, v: (B, T, Hkv, dk), expanded here to H heads.

        cache (generation): the block's LayerCache; the recurrence starts from its memory state.
        doc_start (training, documents kept apart): the state is zeroed at each document start.
        """
        gamma_logit, beta_logit, gate_logit = projected
        B, T, H, D = q.shape
        group = H // k.shape[2]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        log_gamma = F.logsigmoid(gamma_logit.float() + RETENTION_OFFSET) + self.log_gamma_max
        beta = torch.sigmoid(beta_logit.float())
        r = self.recurrence(q, k, v, log_gamma, beta, cache, doc_start)
        gate = torch.sigmoid(gate_logit).reshape(B, T, H, D)
        return self.proj((rms_norm(r) * gate).reshape(B, T, H * D))

    def recurrence(self, q, k, v, log_gamma, beta, cache=None, doc_start=None) -> torch.Tensor:
        """r_t = M_t q_t by the configured kernel: over the whole sequence from a zero state, or on from
        the cache's state (a prefill chunk: chunked form, final state stored; a decode step: in place)."""
        if cache is not None and cache.decoding:
            state = cache.state("memory")
            step = (x[:, 0] for x in (q, k, v, log_gamma, beta))
            return gated_delta_step_(state.pool, state.slots, *step)[:, None]
        state = None if cache is None else cache.state("memory")
        r, final = gated_delta(
            q, k, v, log_gamma, beta, impl=self.impl, chunk_size=self.chunk, what="model.memory_impl",
            initial_state=None if state is None else state.read(), doc_start=doc_start,
        )  # fmt: skip
        if state is not None:
            state.write(final)
        return r

    def zero_output(self) -> None:
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
