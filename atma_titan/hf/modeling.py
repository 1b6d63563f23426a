"""`AtmaForCausalLM`: the ATMA model as a transformers PreTrainedModel, and the cache `generate()` carries.

The weights live in one `atma_titan.models.ATMA` (`self.model`, so the checkpoint keys are
`model.<atma key>`); the forward is ATMA's own, so the logits are the same as atma_titan's.

Generation: ATMA keeps, per sequence, K/V pages for the global blocks and conv / Canon / memory
states (atma_titan.inference.ModelCache), which no transformers Cache class holds. `AtmaCache`
wraps a ModelCache with one slot per batch row. The model says it supports no default
DynamicCache, so `generate()` creates none and the first forward with use_cache creates an
AtmaCache and returns it; generate passes it back for the next tokens. Left padding
(attention_mask zeros) is handled by running each row's real tokens only: a padding position
gets zero hidden states and is never cached.

This module exists to integrate transformers (the `hf` extra) and imports it: without it, importing the
module is a one-line MissingExtraError naming the extra. Code that must run without the extra imports
it on first use.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from atma_titan.hf.configuration import FEATURE, AtmaConfig
from atma_titan.inference.cache import ModelCache
from atma_titan.kernels.paged import gather_pages, write_pages
from atma_titan.models import ATMA, ModelArgs
from atma_titan.utils.errors import import_optional

transformers = import_optional("transformers", "hf", FEATURE)
outputs = import_optional("transformers.modeling_outputs", "hf", FEATURE, "transformers")

__all__ = ["AtmaCache", "AtmaForCausalLM", "AtmaPreTrainedModel"]

PAGE_SIZE = 16
# transformers 5 names the output's cache `cache`; 4.x named it `past_key_values`
CACHE_FIELD = "cache" if "cache" in outputs.CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class AtmaCache:
    """What generation keeps for a batch of `batch` sequences: a ModelCache, slot b + 1 for row b.

    `lengths[b]` is the number of row b's real tokens cached; `seen` the number of input positions
    consumed, padding included (what transformers calls the cached sequence length). The pages hold
    `capacity` tokens per row and grow (doubling, copied) when a step needs more.
    """

    is_linear = [False]  # transformers' check of a user-passed cache: slice input_ids by get_seq_length()
    is_croppable = False

    def __init__(self, args: ModelArgs, batch: int, capacity: int, dtype: torch.dtype, device: torch.device):
        self.args, self.batch, self.dtype, self.device = args, batch, dtype, torch.device(device)
        self.lengths = [0] * batch
        self.seen = 0
        self.capacity = 0
        self.cache: ModelCache | None = None
        self.slots = torch.arange(1, batch + 1, device=self.device)
        self._grow(capacity)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens per row."""
        if tokens > self.capacity:
            self._grow(max(tokens, 2 * self.capacity))

    def _grow(self, tokens: int) -> None:
        capacity = math.ceil(tokens / PAGE_SIZE) * PAGE_SIZE
        new = ModelCache(
            self.args, max_seqs=self.batch, max_context=capacity, page_size=PAGE_SIZE, dtype=self.dtype,
            device=self.device,
        )  # fmt: skip
        for _ in range(self.batch):
            new.admit(capacity)  # slots 1..batch, in order
        old = self.cache
        if old is not None:  # copy the states and every cached key and value
            for i, pools in old.pools.items():
                for name, pool in pools.items():
                    new.pools[i][name].copy_(pool)
            old_tables, new_tables = old.block_tables[self.slots], new.block_tables[self.slots]
            positions = torch.arange(self.capacity, device=self.device).expand(self.batch, -1)
            for i, k_pages in old.k_pages.items():
                k = gather_pages(k_pages, old_tables)[:, : self.capacity]
                v = gather_pages(old.v_pages[i], old_tables)[:, : self.capacity]
                write_pages(new.k_pages[i], new.v_pages[i], new_tables, positions, k, v)
        self.cache, self.capacity = new, capacity

    def prefill(self, model: ATMA, row: int, tokens: torch.Tensor) -> torch.Tensor:
        """Row `row`'s new tokens (n,) -> their hidden states (n, d), cached after its earlier ones."""
        start = self.lengths[row]
        self.reserve(start + len(tokens))
        h, _ = model.trunk(tokens[None], self.cache.prefill(row + 1, start, start + len(tokens)))
        self.lengths[row] += len(tokens)
        return h[0]

    def decode(self, model: ATMA, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row (batch,) -> hidden states (batch, 1, d)."""
        self.reserve(max(self.lengths) + 1)
        positions = torch.tensor(self.lengths, device=self.device)
        h, _ = model.trunk(tokens[:, None], self.cache.decode(self.slots, positions))
        self.lengths = [n + 1 for n in self.lengths]
        return h


class AtmaPreTrainedModel(transformers.PreTrainedModel):
    config_class = AtmaConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]

    def _init_weights(self, module) -> None:
        """Nothing here: a loaded model gets every weight from the checkpoint; a new one (from_config)
        gets ATMA's own initial weights in AtmaForCausalLM.__init__."""


class AtmaForCausalLM(AtmaPreTrainedModel, transformers.GenerationMixin):
    def __init__(self, config: AtmaConfig):
        super().__init__(config)
        self.model = ATMA(config.to_model_args())
        if not any(p.is_meta for p in self.model.parameters()):
            self.model.init_weights()
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the forward makes its own AtmaCache (see the module docstring)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value) -> None:
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: AtmaCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values: AtmaCache | None = None,
        **kwargs,
    ):
        """input_ids (B, T) -> CausalLMOutputWithPast: fp32 logits (B, T, V), the loss when labels are
        given (next-token cross-entropy, -100 ignored), the AtmaCache when use_cache."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("AtmaForCausalLM takes input_ids (inputs_embeds is not supported)")
        cache = cache if cache is not None else past_key_values
        use_cache = bool(use_cache)  # generate() passes it; a plain call is the model's plain forward
        if cache is not None and not isinstance(cache, AtmaCache):
            raise TypeError(f"AtmaForCausalLM needs an AtmaCache, not {type(cache).__name__}")
        mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
        if use_cache or cache is not None:
            if cache is None:
                b, t = input_ids.shape
                cache = AtmaCache(self.model.args, b, 2 * t, self.model.embed.weight.dtype, input_ids.device)
            h = self._cached_trunk(input_ids, mask, cache)
            cache.seen += input_ids.shape[1]
        else:
            h = self._trunk(input_ids, mask)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.model.head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        return outputs.CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})

    def _trunk(self, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            return self.model.trunk(input_ids)[0]
        h = self._hidden_like(input_ids)
        for b in range(input_ids.shape[0]):  # each row's real tokens only
            h[b, mask[b]] = self.model.trunk(input_ids[b, mask[b]][None])[0][0]
        return h

    def _cached_trunk(self, input_ids: torch.Tensor, mask: torch.Tensor | None, cache: AtmaCache) -> torch.Tensor:
        if input_ids.shape[0] != cache.batch:
            raise ValueError(f"the cache holds {cache.batch} sequences, the input {input_ids.shape[0]}")
        if input_ids.shape[1] == 1 and cache.seen > 0:  # a decode step: every row at once
            return cache.decode(self.model, input_ids[:, 0])
        h = self._hidden_like(input_ids)
        for b in range(input_ids.shape[0]):
            keep = slice(None) if mask is None else mask[b, -input_ids.shape[1] :]
            if input_ids[b, keep].numel():
                h[b, keep] = cache.prefill(self.model, b, input_ids[b, keep])
        return h

    def _hidden_like(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        weight = self.model.embed.weight
        return torch.zeros(b, t, self.model.args.d_model, dtype=weight.dtype, device=weight.device)
