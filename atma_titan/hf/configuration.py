"""`AtmaConfig`: the transformers config of an exported ATMA model; its keys are the ModelArgs fields.

This module exists to integrate transformers (the `hf` extra) and imports it: without it, importing the
module is a one-line MissingExtraError naming the extra. Code that must run without the extra imports
it on first use.
"""

from __future__ import annotations

import dataclasses

from atma_titan.models import ModelArgs
from atma_titan.utils.errors import import_optional

FEATURE = "the Hugging Face model (atma_titan.hf)"
transformers = import_optional("transformers", "hf", FEATURE)

__all__ = ["MODEL_TYPE", "AtmaConfig"]

MODEL_TYPE = "atma"
ARG_NAMES = tuple(f.name for f in dataclasses.fields(ModelArgs))


class AtmaConfig(transformers.PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, **kwargs):
        # ModelArgs' own defaults for keys left out; the shape keys have none (None until set)
        defaults = {f.name: f.default for f in dataclasses.fields(ModelArgs) if f.default is not dataclasses.MISSING}
        for name in ARG_NAMES:
            value = kwargs.pop(name, defaults.get(name))
            setattr(self, name, list(value) if name == "global_layers" and value is not None else value)
        self.use_cache = kwargs.pop("use_cache", True)  # generate() keeps an AtmaCache unless told otherwise
        kwargs.setdefault("tie_word_embeddings", False)  # the LM head is untied
        super().__init__(**kwargs)

    @classmethod
    def from_model_args(cls, args: ModelArgs, **kwargs):
        return cls(**dataclasses.asdict(args), **kwargs)

    def to_model_args(self) -> ModelArgs:
        values = {name: getattr(self, name) for name in ARG_NAMES}
        values["global_layers"] = tuple(values["global_layers"] or ())
        return ModelArgs(**values)
