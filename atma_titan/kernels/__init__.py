"""Attention and recurrence kernels; they know nothing about models.

One entry point per op, choosing the implementation by `impl` (auto | triton | reference, see
backends.py, where the Triton environment flags are read once):

- `polar.polar_attention(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null, *, window, impl, ...)`
- `gated_delta.gated_delta(q, k, v, log_gamma, beta, *, impl, chunk_size, initial_state, normalize_qk)`
  (impl may also be `fla`)
- `softcap_ce.softcap_ce_forward(logits, targets, scale, cap, *, impl)` and `softcap_ce_backward_(...)`
  (the LM head's soft-capped cross-entropy over rows of logits; the gradient is written in place)

The op folders have the same files: reference.py (PyTorch references, the ground truth), ops.py (the
entry point, and the torch.library custom ops where the op is called from compiled code) and
triton_*.py (the Triton kernels and their launchers, imported on the first kernel call).
"""
