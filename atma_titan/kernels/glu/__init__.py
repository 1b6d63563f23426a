"""The MLP's gated linear unit: its forward in PyTorch, and its backward fused into one pass.

- reference.py: the math (`glu`, `glu_backward_reference`), in PyTorch.
- ops.py: `glu_backward` by impl (auto | triton | reference), and the torch.library op it calls.
- triton_glu.py: the Triton backward kernel and its launcher, imported on the first kernel call.
"""

from atma_titan.kernels.glu.ops import glu_backward
from atma_titan.kernels.glu.reference import GLU_KINDS, check_kind, glu, glu_backward_reference

__all__ = ["GLU_KINDS", "check_kind", "glu", "glu_backward", "glu_backward_reference"]
