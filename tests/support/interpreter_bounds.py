"""A bounds check for kernels run under Triton's CPU interpreter, which itself reads and writes host memory
unchecked: an out-of-bounds tl.load returns whatever lies there, an out-of-bounds tl.store corrupts it.

`interpreter_bounds_check()` fails any interpreted masked tl.load / tl.store with a masked-in address
outside every tensor argument of its launch. The gated delta, GLU, conv and cross-entropy cases of
tests/kernels/interpreter/ run every launch under it; it cannot follow pointer tables (Muon's cases fence
every tensor with a sentinel instead).
"""

import contextlib

import numpy as np
import torch


@contextlib.contextmanager
def interpreter_bounds_check():
    """Fail any interpreted tl.load / tl.store whose masked-in addresses leave the launch's tensor arguments."""
    import triton.runtime.interpreter as interpreter

    extents = []
    builder = interpreter.interpreter_builder
    init_args, load, store = (
        interpreter.GridExecutor._init_args_hst,
        builder.create_masked_load,
        builder.create_masked_store,
    )

    def record_extents(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        extents.clear()
        for arg in [*args_hst, *kwargs_hst.values()]:
            arg = getattr(arg, "base", arg)  # TensorWrapper
            if isinstance(arg, torch.Tensor):
                assert arg.is_contiguous(), "the bounds check assumes contiguous tensor arguments"
                extents.append((arg.data_ptr(), arg.data_ptr() + arg.numel() * arg.element_size()))
        return args_hst, kwargs_hst

    def check(ptrs, mask, what):
        addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)]
        if addresses.size == 0:
            return
        itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(addresses.shape, dtype=bool)
        for start, end in extents:
            inside |= (addresses >= start) & (addresses + itemsize <= end)
        if not inside.all():
            raise AssertionError(
                f"out-of-bounds {what} of {int((~inside).sum())} elements in program {builder.grid_idx}"
            )

    def checked_load(ptrs, mask, other, *args):
        check(ptrs, mask, "tl.load")
        return load(ptrs, mask, other, *args)

    def checked_store(ptrs, value, mask, *args):
        check(ptrs, mask, "tl.store")
        return store(ptrs, value, mask, *args)

    interpreter.GridExecutor._init_args_hst = record_extents
    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    try:
        yield
    finally:
        interpreter.GridExecutor._init_args_hst = init_args
        builder.create_masked_load, builder.create_masked_store = load, store
