"""Generation: the paged KV cache and state slots, sampling, and the batching generator.

- cache.py: `ModelCache` (K/V pages of the global blocks, a state slot per sequence for the conv,
  Canon and memory states, block tables) and the views a forward reads (`StepCache`, `LayerCache`).
- sampling.py: greedy, temperature, top-k, top-p.
- engine.py: `Generator` (prefill, decode steps in CUDA graphs, continuous batching).

The command is `python -m atma_titan.generate` (atma_titan/generate.py); docs/generation.md explains it.
"""

from atma_titan.inference.cache import CacheFullError, ModelCache
from atma_titan.inference.engine import Event, Generator, Request, cast_for_inference
from atma_titan.inference.sampling import Sampling, allowed_tokens, sample

__all__ = [
    "CacheFullError",
    "Event",
    "Generator",
    "ModelCache",
    "Request",
    "Sampling",
    "allowed_tokens",
    "cast_for_inference",
    "sample",
]
