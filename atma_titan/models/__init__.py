"""The ATMA model: plain nn.Modules, flavors, the builder, and the per-component parameter breakdown."""

from atma_titan.models.atma import ATMA, Block, parameter_breakdown
from atma_titan.models.builder import build_model, initial_weights
from atma_titan.models.flavors import FLAVORS, ModelArgs, resolve_model_args

__all__ = [
    "ATMA",
    "Block",
    "FLAVORS",
    "ModelArgs",
    "build_model",
    "initial_weights",
    "parameter_breakdown",
    "resolve_model_args",
]
