"""The ATMA decoder (docs/model.md section 1): pre-norm blocks, final RMSNorm, untied soft-capped LM head.

    h = h + mixer(norm1(h));  h = h + mlp(norm2(h))

Blocks listed in `args.global_layers` mix with Polar (or softmax) attention plus the gated-delta
memory; the others with the LFM2 gated short convolution. The model knows nothing about
parallelism: it is built on the meta device, sharded by `atma_titan.parallel`, materialised, and
then `init_weights()` gives every parameter its initial value.
"""

from __future__ import annotations

import torch
from torch import nn

from atma_titan.kernels.documents import check_doc_start
from atma_titan.models.attention import GlobalAttention
from atma_titan.models.conv import GatedShortConv
from atma_titan.models.flavors import ModelArgs
from atma_titan.models.layers import MLP, RMSNorm
from atma_titan.models.loss import LossTargets, linear_softcap_cross_entropy, softcap


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.is_global = args.is_global(layer_id)
        self.norm1 = RMSNorm(args.d_model, args.norm_eps)
        self.mixer = GlobalAttention(args) if self.is_global else GatedShortConv(args)
        self.norm2 = RMSNorm(args.d_model, args.norm_eps)
        self.mlp = MLP(args.d_model, args.mlp_hidden, args.mlp, args.mlp_impl)

    def forward(self, h: torch.Tensor, cache=None, doc_start=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        mixed, aux = self.mixer(self.norm1(h), cache, doc_start)
        h = h + mixed
        return h + self.mlp(self.norm2(h)), aux


class ATMA(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.d_model)
        # A ModuleDict keyed by the block index keeps checkpoint keys stable under AC/compile wrappers.
        self.blocks = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.d_model, args.norm_eps)
        self.head = SoftcapHead(args.d_model, args.vocab_size, args.logit_softcap, args.loss_impl)

    def forward(
        self,
        tokens: torch.Tensor,
        return_aux: bool = False,
        cache=None,
        targets: LossTargets | None = None,
        doc_start: torch.Tensor | None = None,
    ):
        """tokens (B, T) -> fp32 logits (B, T, V); with return_aux also the summed auxiliary loss.

        cache (generation): an `atma_titan.inference` StepCache. The tokens then continue sequences
        whose earlier tokens it holds (keys and values, conv and memory states), and it is updated.
        targets (training): return the summed next-token cross-entropy against targets.labels instead
        of the logits, computed by the head chunk by chunk (atma_titan.models.loss).
        doc_start (training with documents kept apart): int32 (B, T), where each token's document begins
        (atma_titan.kernels.documents); every mixer then reads only within a token's own document.
        """
        h, aux = self.trunk(tokens, cache, doc_start)
        out = self.head(h) if targets is None else self.head(h, targets)
        return (out, aux) if return_aux else out

    def trunk(self, tokens: torch.Tensor, cache=None, doc_start=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens (B, T) -> final-normed hidden states (B, T, d) and the summed auxiliary loss.

        Evaluation at long lengths applies `head` to slices of these, never holding (T x vocab) logits.
        """
        if doc_start is not None:
            if cache is not None:
                raise ValueError("doc_start is for training windows; a cache continues one document per sequence")
            check_doc_start(doc_start, *tokens.shape)
        h = self.embed(tokens)
        aux_total = None
        for i, block in self.blocks.items():
            h, aux = block(h, None if cache is None else cache.layer(int(i)), doc_start)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        return self.norm(h), aux_total

    @torch.no_grad()
    def init_weights(self) -> None:
        """PyTorch's default Linear/Embedding init, then zero every residual branch's output and the head.

        Deliberately NOT zeroed: the LFM2 `in_proj` (the published scripts zeroed every "*proj*",
        which froze all conv blocks at a constant output; docs/model.md section 5).
        """
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for block in self.blocks.values():
            if isinstance(block.mixer, GlobalAttention) and block.mixer.args.attention == "polar":
                block.mixer.reset_polar_scalars()
            block.mixer.zero_output()
            nn.init.zeros_(block.mlp.proj.weight)
            nn.init.zeros_(block.mlp.proj.bias)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)


class SoftcapHead(nn.Linear):
    """The untied LM head: a biased Linear whose logits are soft-capped in fp32.

    One module (parameter names `head.weight`, `head.bias`) so it can be compiled as a unit, which
    fuses the cast and the cap instead of materialising several (tokens x vocab) fp32 tensors.
    Given `targets` it returns the summed cross-entropy instead (atma_titan.models.loss): the same
    value without ever holding the logits. That path goes through this forward so that FSDP2's
    hooks (which fire on module calls) gather the head's parameters for it.
    """

    def __init__(self, d_model: int, vocab_size: int, cap: float, loss_impl: str = "auto"):
        super().__init__(d_model, vocab_size)
        self.cap, self.loss_impl = cap, loss_impl

    def forward(self, x: torch.Tensor, targets: LossTargets | None = None) -> torch.Tensor:
        if targets is not None:
            return linear_softcap_cross_entropy(
                x,
                self.weight,
                self.bias,
                targets.labels,
                targets.weights,
                cap=self.cap,
                chunk_mib=targets.chunk_mib,
                compile_backend=targets.compile_backend,
                impl=self.loss_impl,
            )
        return softcap(super().forward(x).float(), self.cap)


def parameter_breakdown(model: ATMA) -> dict[str, int]:
    """Parameter counts by component, in the terms of docs/model.md section 1.1 (the fidelity check)."""
    counts = {"embedding": 0, "lm_head": 0, "norms": 0, "mlp": 0, "conv_blocks": 0, "attention_blocks": 0, "memory": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("embed."):
            counts["embedding"] += n
        elif name.startswith("head."):
            counts["lm_head"] += n
        elif ".norm" in name or name.startswith("norm."):
            counts["norms"] += n
        elif ".mlp." in name:
            counts["mlp"] += n
        elif ".mixer.memory." in name:
            counts["memory"] += n
        elif isinstance(model.blocks[name.split(".")[1]].mixer, GlobalAttention):
            counts["attention_blocks"] += n
        else:
            counts["conv_blocks"] += n
    return counts


def non_embedding_params(model: ATMA) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed."))
