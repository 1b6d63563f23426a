"""Muon's element-wise work on many matrices at once: the momentum and update before Newton-Schulz
(`stage_momentum_`), and the momentum write-back, weight decay and update after it (`apply_updates_`).

- reference.py: the PyTorch reference (foreach ops).
- ops.py: the entry points, by impl (auto | triton | reference).
- triton_muon.py: the Triton kernels and their launchers, imported on the first kernel call.
"""

from atma_titan.kernels.muon_update.ops import apply_updates_, stage_momentum_
from atma_titan.kernels.muon_update.reference import apply_updates_reference_, stage_momentum_reference_

__all__ = ["apply_updates_", "apply_updates_reference_", "stage_momentum_", "stage_momentum_reference_"]
