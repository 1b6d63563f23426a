"""The global mixer: Polar (or softmax) attention with Canon convolutions, plus the memory branch.

Polar (docs/model.md section 3) replaces softmax's "weights sum to one" with a null entry whose logit
grows like the max of n noise logits, a length temperature, and two outputs: a unit direction c
(what was found) and a bounded count mag (how much was found):

    out = W_o(concat_h(s * c) * sigmoid(gate)) + W_mu(mag) + memory

with s = sqrt(head_dim) (model.polar_direction = "rms", the default) or 1 ("unit", the paper's form).

With a cache (generation, `atma_titan.inference`) the same block continues cached sequences: a
prefill chunk attends over every cached key (the kernels take queries at an offset), a decode step
reads the keys from the cache's pages with the paged decode kernel (Polar) or its plain path (softmax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atma_titan.kernels.documents import positions_in_document
from atma_titan.kernels.paged import softmax_decode
from atma_titan.kernels.polar import polar_attention, polar_decode, polar_scalars
from atma_titan.models.flavors import ModelArgs
from atma_titan.models.layers import CausalDepthwiseConv, fused_linear, rms_norm, rotary
from atma_titan.models.memory import GatedDeltaMemory

# Raw initial values of the per-head Polar scalars (softplus is applied where they are used).
POLAR_INIT = {"len_gain": -1.0, "null_base": 2.0, "null_slope": 0.5, "mag_beta": -1.5}


class GlobalAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H, Hkv, D, d = args.n_heads, args.n_kv_heads, args.head_dim, args.d_model
        self.q_proj = nn.Linear(d, 2 * H * D)  # per head: [query | output gate]
        self.k_proj = nn.Linear(d, Hkv * D)
        self.v_proj = nn.Linear(d, Hkv * D)
        self.o_proj = nn.Linear(H * D, d)
        if args.canon:
            self.canon_q = CausalDepthwiseConv(H * D, args.canon_kernel)
            self.canon_k = CausalDepthwiseConv(Hkv * D, args.canon_kernel)
            self.canon_v = CausalDepthwiseConv(Hkv * D, args.canon_kernel)
        if args.attention == "polar":
            self.mu_proj = nn.Linear(H, d)  # W_mu: the count channel
            # A unit vector's elements have RMS 1/sqrt(D); under Adam/Muon (scale-free updates) W_o's effect
            # on the output grows with its input's size, so a unit c would make the attention path learn
            # sqrt(D) times slower than the memory readout (RMS-normed) and the MLPs beside it.
            self.direction_scale = D**0.5 if args.polar_direction == "rms" else 1.0
            for name in POLAR_INIT:
                setattr(self, name, nn.Parameter(torch.empty(H)))
            self.v_null = nn.Parameter(torch.empty(H, D))
            self.reset_polar_scalars()
        self.memory = GatedDeltaMemory(args) if args.memory else None

    def reset_polar_scalars(self) -> None:
        for name, value in POLAR_INIT.items():
            nn.init.constant_(getattr(self, name), value)
        nn.init.zeros_(self.v_null)

    def zero_output(self) -> None:
        for proj in (self.o_proj, getattr(self, "mu_proj", None)):
            if proj is not None:
                nn.init.zeros_(proj.weight)
                nn.init.zeros_(proj.bias)
        if self.memory is not None:
            self.memory.zero_output()

    def project(self, x: torch.Tensor, cache=None, doc_start=None) -> tuple:
        """x (B, T, d) -> q, gate (B, T, H, D) and k, v (B, T, Hkv, D), normalised and position-mixed, and
        the memory's projections of x (None without a memory): every projection of x in one matrix product,
        except in a decode step, which reads each weight once as it is. With doc_start the Canon
        convolutions do not reach back across a document start."""
        a = self.args
        B, T, _ = x.shape
        memory_inputs = self.memory.input_projections() if self.memory is not None else []
        linears = [self.q_proj, self.k_proj, self.v_proj, *memory_inputs]
        if cache is not None and cache.decoding:  # one token a sequence: stacking would copy every weight per token
            q, k, v, *projected = [linear(x) for linear in linears]
        else:
            q, k, v, *projected = fused_linear(x, linears)
        q, gate = q.view(B, T, a.n_heads, 2 * a.head_dim).chunk(2, dim=-1)
        k = k.view(B, T, a.n_kv_heads, a.head_dim)
        v = v.view(B, T, a.n_kv_heads, a.head_dim)
        q, k = rms_norm(q, a.norm_eps), rms_norm(k, a.norm_eps)  # ||q||^2 = ||k||^2 = D
        if a.position == "rope":
            positions = None if cache is None else cache.positions
            q, k = rotary(q, a.rope_theta, positions), rotary(k, a.rope_theta, positions)
        if a.canon:

            def state(name):
                return None if cache is None else cache.state(name)

            q = q + self.canon_q(q.flatten(2), state("canon_q"), doc_start).view_as(q)
            k = k + self.canon_k(k.flatten(2), state("canon_k"), doc_start).view_as(k)
            v = v + self.canon_v(v.flatten(2), state("canon_v"), doc_start).view_as(v)
        return q, gate, k, v, (projected if self.memory is not None else None)

    def forward(self, x: torch.Tensor, cache=None, doc_start=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """cache (generation): the block's `atma_titan.inference` LayerCache (pages and states).
        doc_start (training, documents kept apart): int32 (B, T), where each token's document begins
        (atma_titan.kernels.documents): attention, the memory and the Canon convolutions stay inside it."""
        a = self.args
        B, T, _ = x.shape
        q, gate, k, v, projected = self.project(x, cache, doc_start)
        aux = None
        if a.attention == "polar":
            c, mag = self.polar(q, k, v, cache, doc_start)
            c = c * self.direction_scale
            out = self.o_proj((c * torch.sigmoid(gate)).reshape(B, T, -1)) + self.mu_proj(mag.to(x.dtype))
            if a.distractor_weight > 0 and self.training:
                aux = a.distractor_weight * self.distractor_loss(q, doc_start)
        else:
            o = self.softmax(q, k, v, cache, doc_start)
            out = self.o_proj((o * torch.sigmoid(gate)).reshape(B, T, -1))
        if self.memory is not None:
            out = out + self.memory(projected, q, k, v, cache, doc_start)
        return out, aux

    def polar(self, q, k, v, cache=None, doc_start=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The Polar core: direction c (B, T, H, D) and count mag (B, T, H), by the configured kernel."""
        a = self.args
        scalars = (self.len_gain, self.null_base, self.null_slope, self.mag_beta, self.v_null)
        if cache is not None and cache.decoding:  # one token per sequence, keys read from the pages
            c, mag = polar_decode(
                q[:, 0], *cache.append_kv(k, v), *scalars, window=a.window, impl=a.attention_impl,
                what="model.attention_impl",
            )  # fmt: skip
            return c[:, None], mag[:, None]
        if cache is not None:  # a prefill chunk: the queries are the last T of all cached keys
            k, v = cache.extend_kv(k, v)
        return polar_attention(
            q, k, v, *scalars, window=a.window, doc_start=doc_start, impl=a.attention_impl,
            block_q=a.attention_block, block_k=a.attention_block, what="model.attention_impl",
        )  # fmt: skip

    def softmax(self, q, k, v, cache=None, doc_start=None) -> torch.Tensor:
        """Softmax attention (the ablation) over the block's keys, or the cached keys as well."""
        if cache is not None and cache.decoding:
            return softmax_decode(q[:, 0], *cache.append_kv(k, v), window=self.args.window)[:, None]
        if cache is not None:
            k, v = cache.extend_kv(k, v)
        return softmax_attention(q, k, v, self.args.window, doc_start)

    def distractor_loss(self, q: torch.Tensor, doc_start=None) -> torch.Tensor:
        """Mean softmax mass that R random keys take from the null entry, at each query's own n (the keys
        it sees: its position + 1, or in its own document with doc_start; at most the window).

        The random keys go through k_proj and the RMS norm but are detached: the loss teaches the
        queries, the temperature and the null floor to reject noise, not the keys to hide from it.
        """
        a = self.args
        B, T, H, D = q.shape
        noise = torch.randn(a.distractor_keys, a.d_model, device=q.device, dtype=q.dtype)
        keys = rms_norm(self.k_proj(noise).view(-1, a.n_kv_heads, D), a.norm_eps).detach()
        keys = keys.repeat_interleave(H // a.n_kv_heads, dim=1)  # (R, H, D)
        scores = torch.einsum("bthd,rhd->bthr", q.float(), keys.float()) / D**0.5
        if doc_start is None:
            n = torch.arange(1, T + 1, device=q.device, dtype=torch.float32)[None]
        else:
            n = (positions_in_document(doc_start) + 1).float()
        if a.window:
            n = n.clamp(max=a.window)
        temp, null = polar_scalars(n[..., None], self.len_gain, self.null_base, self.null_slope)  # (1 or B, T, H)
        logits = torch.cat([scores, null[..., None].expand(B, T, H, 1)], dim=-1) * temp[..., None]
        return logits.softmax(dim=-1)[..., :-1].sum(-1).mean()


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, doc_start=None) -> torch.Tensor:
    """Causal softmax attention with GQA, optionally limited to the last `window` keys.

    q (B, Tq, H, D); k, v (B, Tk, Hkv, D) with Tq <= Tk: the queries are the last Tq key positions.
    doc_start (B, Tk): a query sees only keys from its own document's start on (an explicit mask: SDPA's
    flash path takes none, so the softmax ablation with documents runs on its memory-efficient kernel).
    """
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    group = q.shape[2] // k.shape[2]
    if group > 1:  # explicit expansion: enable_gqa is not available on every backend we run
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    tq, tk = q.shape[1], k.shape[1]
    if window or tq != tk or doc_start is not None:
        i = torch.arange(tk - tq, tk, device=q.device)[:, None]  # query positions
        j = torch.arange(tk, device=q.device)[None, :]
        mask = j <= i
        if window:
            mask &= j > i - window
        if doc_start is not None:  # (B, 1, Tq, Tk): the batch's own documents, broadcast over heads
            mask = mask & (j >= doc_start[:, tk - tq :, None])[:, None]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    else:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    return o.transpose(1, 2)
