"""Attention, recurrence and training kernels; they know nothing about models.

Each op is a folder with one entry point (its ops.py) that picks the implementation by `impl`
(auto | triton | reference; see backends.py):

- polar/: polar attention, `polar_attention(q, k, v, len_gain, ..., *, window, impl)`, and `polar_decode`.
- gated_delta/: the gated delta rule, `gated_delta(q, k, v, log_gamma, beta, *, impl, ...)` (impl may be `fla`).
- softcap_ce/: the LM head's soft-capped cross-entropy, `softcap_ce_forward` and the in-place `softcap_ce_backward_`.
- muon_update/: Muon's element-wise steps over many matrices, `stage_momentum_` and `apply_updates_`.
- glu/: the MLP's gated linear unit, `glu`, and its backward fused into one pass, `glu_backward`.
- short_conv/: the LFM2 block's gated short convolution, `gated_conv`, and its fused `gated_conv_backward`.
- paged.py: the paged KV cache as the decode kernels read it (`write_pages`, `gather_pages`, `softmax_decode`).
- backends.py: which implementation runs (`use_triton`), and the Triton environment flags, read once.
- resources.py: what a compiled Triton config needs from a GPU, and an `autotune` that keeps the configs that fit.

The op folders have the same files: reference.py (PyTorch references, the ground truth), ops.py (the
entry point, and the torch.library custom ops where the op is called from compiled code) and
triton_*.py (the Triton kernels and their launchers, imported on the first kernel call).
"""
