"""Attention and recurrence kernels. Each op has a plain-PyTorch reference beside its Triton kernel;
kernels know nothing about models."""
