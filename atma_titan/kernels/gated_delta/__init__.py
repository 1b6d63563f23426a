"""Gated delta rule: exact recurrence and chunked (WY/UT) references."""

from atma_titan.kernels.gated_delta.reference import gated_delta_chunked, gated_delta_recurrent

__all__ = ["gated_delta_chunked", "gated_delta_recurrent"]
