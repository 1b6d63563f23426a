"""Polar attention: streaming and materialised references."""

from atma_titan.kernels.polar.reference import polar_attention, polar_attention_naive

__all__ = ["polar_attention", "polar_attention_naive"]
