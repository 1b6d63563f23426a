"""`AtmaConfig`: the transformers config of an exported ATMA model; its keys are the ModelArgs fields.

The class subclasses transformers.PretrainedConfig, so it is made on first use (`from
atma_titan.hf.configuration import AtmaConfig` makes it): the module itself imports without the
`hf` extra.
"""

from __future__ import annotations

import dataclasses
import functools

from atma_titan.utils.errors import import_optional
from atma_titan.models import ModelArgs

__all__ = ["MODEL_TYPE", "atma_config_class"]  # and AtmaConfig, made on first use

MODEL_TYPE = "atma"
ARG_NAMES = tuple(f.name for f in dataclasses.fields(ModelArgs))


def __getattr__(name: str):
    if name == "AtmaConfig":
        return atma_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def atma_config_class() -> type:
    transformers = import_optional("transformers", "hf", "the Hugging Face model (atma_titan.hf)")

    class AtmaConfig(transformers.PretrainedConfig):
        model_type = MODEL_TYPE

        def __init__(self, **kwargs):
            # ModelArgs' own defaults for keys left out; the shape keys have none (None until set)
            defaults = {
                f.name: f.default for f in dataclasses.fields(ModelArgs) if f.default is not dataclasses.MISSING
            }
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

    AtmaConfig.__qualname__ = "AtmaConfig"
    return AtmaConfig
