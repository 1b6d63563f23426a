"""torch.library registration of the gated delta Triton kernels, and the public entry points.

`gated_delta(..., impl=)` runs the chunked rule by impl (auto | triton | reference | fla, see
kernels/backends.py); `gated_delta_chunked_triton`, `gated_delta_chunked_fla` and `gated_delta_step_`
are the single implementations.

Registered ops (custom_op everywhere: it compiles with fullgraph=True on CUDA and on CPU, where a
triton_op would make Inductor try to build the kernel):

    atma::gated_delta_chunk_fwd(q, k, v, log_gamma, beta, initial_state?, normalize_qk, keep_workspaces,
                                doc_start?=None) -> (r, final_state, *workspaces)
    atma::gated_delta_chunk_bwd(q, k, v, log_gamma, beta, *workspaces, dr, dfinal, normalize_qk, doc_start?=None)
        -> (dq, dk, dv, dlog_gamma, dbeta, dinitial_state)
    atma::gated_delta_step(state_pool!, slots, q, k, v, log_gamma, beta, normalize_qk) -> r

doc_start (B, T) int (kernels/documents.py) zeroes the state before each document start, in the kernels,
the references and the fla path alike; it is not differentiable. None runs the code of before.

A forward that gradients flow through keeps its workspaces (triton_chunked.WORKSPACES: the UT transform,
the deltas and every chunk's start state, 5.5x the size of v at Dk = Dv = 128) as extra outputs saved
for the backward, so that the backward does not run the forward's two workspace kernels again; any
other forward returns them empty.

Triton (triton_chunked.py, triton_step.py) is imported only when a kernel first runs, so importing
this module (and the model) never needs triton. On CPU the chunked kernels run only under
TRITON_INTERPRET=1 (set before triton is imported); the decode step falls back to the PyTorch
in-place reference there.
"""

from typing import Optional

import torch

from atma_titan.utils.errors import import_optional
from atma_titan.kernels import backends
from atma_titan.kernels.documents import cu_seqlens, positions_in_document
from atma_titan.kernels.gated_delta.reference import (
    _check_shapes,
    _check_step_shapes,
    gated_delta_chunked,
    gated_delta_step_inplace,
)

__all__ = ["gated_delta", "gated_delta_chunked_triton", "gated_delta_step_", "gated_delta_chunked_fla"]


def _require_triton_device(x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not backends.INTERPRET:
        raise RuntimeError(
            f"the Triton gated delta kernels need a CUDA tensor (got {x.device}); on CPU use the PyTorch "
            "reference atma_titan.kernels.gated_delta.gated_delta_chunked, or set TRITON_INTERPRET=1 "
            "before triton is imported to run the kernels in the Triton interpreter"
        )


def _chunked_kernels():
    from atma_titan.kernels.gated_delta import triton_chunked

    return triton_chunked


# ---------------------------------------------------------------------------------------------
# Chunked op (training / prefill)


@torch.library.custom_op("atma::gated_delta_chunk_fwd", mutates_args=())
def _chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor],
    normalize_qk: bool,
    keep_workspaces: bool,
    doc_start: Optional[torch.Tensor] = None,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:  # r, final_state and the six workspaces
    _require_triton_device(q)
    kernels = _chunked_kernels()
    r, final_state, workspaces = kernels.chunk_forward(
        q, k, v, log_gamma, beta, initial_state, normalize_qk, keep_workspaces, doc_start
    )
    return r, final_state, *(workspaces or _no_workspaces(q))


def _no_workspaces(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The empty stand-ins a forward without gradients returns for the workspaces (custom ops have fixed outputs)."""
    return tuple(q.new_empty(0) for _ in _chunked_kernels().WORKSPACES)


@_chunk_fwd.register_fake
def _chunk_fwd_fake(q, k, v, log_gamma, beta, initial_state, normalize_qk, keep_workspaces, doc_start=None):
    batch, _, heads, key_dim = q.shape
    final_state = q.new_empty(batch, heads, v.shape[-1], key_dim, dtype=torch.float32)
    if not keep_workspaces:
        return torch.empty_like(v), final_state, *_no_workspaces(q)
    kernels = _chunked_kernels()
    return torch.empty_like(v), final_state, *kernels.new_workspaces(q, v, kernels.WORKSPACES).values()


@torch.library.custom_op("atma::gated_delta_chunk_bwd", mutates_args=())
def _chunk_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    workspaces: list[torch.Tensor],
    dr: torch.Tensor,
    dfinal: torch.Tensor,
    normalize_qk: bool,
    doc_start: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _require_triton_device(q)
    kernels = _chunked_kernels()
    return kernels.chunk_backward(q, k, v, log_gamma, beta, workspaces, dr, dfinal, normalize_qk, doc_start)


@_chunk_bwd.register_fake
def _chunk_bwd_fake(q, k, v, log_gamma, beta, workspaces, dr, dfinal, normalize_qk, doc_start=None):
    like = (torch.empty_like(x) for x in (q, k, v, log_gamma, beta))
    return (*like, torch.empty_like(dfinal, dtype=torch.float32))


def _chunk_setup_context(ctx, inputs, output):
    q, k, v, log_gamma, beta, initial_state, normalize_qk, keep_workspaces, doc_start = inputs
    _, _, *workspaces = output
    ctx.mark_non_differentiable(*workspaces)
    ctx.save_for_backward(q, k, v, log_gamma, beta, doc_start, *workspaces)
    ctx.normalize_qk = normalize_qk
    ctx.kept_workspaces = keep_workspaces
    ctx.initial_dtype = None if initial_state is None else initial_state.dtype


def _chunk_backward(ctx, dr, dfinal, *_workspace_grads):
    if not ctx.kept_workspaces:
        raise RuntimeError(
            "atma::gated_delta_chunk_fwd ran with keep_workspaces=False, so it cannot be differentiated: "
            "call gated_delta_chunked_triton, which keeps them whenever gradients flow"
        )
    q, k, v, log_gamma, beta, doc_start, *workspaces = ctx.saved_tensors
    if dr is None:
        dr = torch.zeros_like(v)
    if dfinal is None:
        dfinal = q.new_zeros(q.shape[0], q.shape[2], v.shape[-1], q.shape[-1], dtype=torch.float32)
    dq, dk, dv, dlog_gamma, dbeta, dinitial = torch.ops.atma.gated_delta_chunk_bwd(
        q, k, v, log_gamma, beta, workspaces, dr, dfinal, ctx.normalize_qk, doc_start
    )
    dinitial = None if ctx.initial_dtype is None else dinitial.to(ctx.initial_dtype)
    return dq, dk, dv, dlog_gamma, dbeta, dinitial, None, None, None


_chunk_fwd.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)


def gated_delta_chunked_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    normalize_qk: bool = True,
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton chunked gated delta rule (chunk 64); same arguments and results as
    reference.gated_delta_chunked, differentiable in every input including initial_state.

    q, k, v share one dtype (bf16, fp16 or fp32); r comes back in it, final_state in fp32.
    doc_start (B, T) int: the state is zeroed before each document start (kernels/documents.py).
    """
    _check_shapes(q, k, v, log_gamma, beta, initial_state, doc_start)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    inputs = (q, k, v, log_gamma, beta, initial_state)
    keep_workspaces = backends.gradients_flow(*inputs)
    r, final_state, *_ = torch.ops.atma.gated_delta_chunk_fwd(*inputs, normalize_qk, keep_workspaces, doc_start)
    return r, final_state


# ---------------------------------------------------------------------------------------------
# Decode step (in place on a state pool)


@torch.library.custom_op("atma::gated_delta_step", mutates_args=("state_pool",))
def _step(
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    normalize_qk: bool,
) -> torch.Tensor:
    if state_pool.device.type == "cuda" or backends.INTERPRET:
        from atma_titan.kernels.gated_delta.triton_step import step_inplace

        return step_inplace(state_pool, slots, q, k, v, log_gamma, beta, normalize_qk)
    return gated_delta_step_inplace(state_pool, slots, q, k, v, log_gamma, beta, normalize_qk=normalize_qk)


@_step.register_fake
def _step_fake(state_pool, slots, q, k, v, log_gamma, beta, normalize_qk):
    return torch.empty_like(v)


def gated_delta_step_(
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    *,
    normalize_qk: bool = True,
) -> torch.Tensor:
    """One decode token: state_pool[slots[b]] (fp32, (slots, H, Dv, Dk)) is updated in place and
    r (B, H, Dv) = M_new q is returned. q, k (B, H, Dk); v (B, H, Dv); log_gamma, beta (B, H).

    Triton on CUDA (CUDA-graph friendly); on CPU the Triton interpreter when TRITON_INTERPRET=1,
    else the PyTorch path (reference.gated_delta_step_inplace). Slots must be distinct.
    """
    _check_step_shapes(state_pool, slots, q, k, v, log_gamma, beta)
    return torch.ops.atma.gated_delta_step(state_pool, slots, q, k, v, log_gamma, beta, normalize_qk)


# ---------------------------------------------------------------------------------------------
# flash-linear-attention backend (benchmarks, model.memory_impl = "fla")


def gated_delta_chunked_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    normalize_qk: bool = True,
    doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunk_gated_delta_rule with our conventions (only if fla-core happens to be installed).

    fla reads r_t = scale * S_t^T q_t with its state S as (B, H, Dk, Dv): we pass scale = 1 and
    transpose the state both ways. Its g is our log_gamma.

    With doc_start, fla runs its varlen form: the batch flattened to one sequence of B * T tokens cut at
    every document start (documents.cu_seqlens), one state per document (N, H, Dk, Dv). Row b's initial
    state goes to its first document (the others start from zero) and its final state is that of its
    last document.
    """
    fla = import_optional("fla.ops.gated_delta_rule", "fla", "model.memory_impl = 'fla'", "fla-core")
    _check_shapes(q, k, v, log_gamma, beta, initial_state, doc_start)
    fla_initial = None if initial_state is None else initial_state.float().transpose(-1, -2).contiguous()
    if doc_start is None:
        r, final_state = fla.chunk_gated_delta_rule(
            q,
            k,
            v,
            g=log_gamma.float(),
            beta=beta,
            scale=1.0,
            initial_state=fla_initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=normalize_qk,
        )
        return r.to(v.dtype), final_state.transpose(-1, -2)

    boundaries = cu_seqlens(doc_start).long()  # fla documents cu_seqlens as a LongTensor
    first, last = _first_and_last_documents(doc_start)
    if fla_initial is not None:
        shape = (boundaries.numel() - 1, *fla_initial.shape[1:])
        fla_initial = fla_initial.new_zeros(shape).index_copy(0, first, fla_initial)
    flat_q, flat_k, flat_v, flat_beta = (x.flatten(0, 1).unsqueeze(0) for x in (q, k, v, beta))
    r, final_states = fla.chunk_gated_delta_rule(
        flat_q,
        flat_k,
        flat_v,
        g=log_gamma.float().flatten(0, 1).unsqueeze(0),
        beta=flat_beta,
        scale=1.0,
        initial_state=fla_initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=normalize_qk,
        cu_seqlens=boundaries,
    )
    return r.reshape(v.shape).to(v.dtype), final_states.index_select(0, last).transpose(-1, -2)


def _first_and_last_documents(doc_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 (B,) each: the indices, among the documents of the flattened batch (cu_seqlens' order), of each
    row's first and last document."""
    per_row = (positions_in_document(doc_start) == 0).sum(dim=-1)
    last = per_row.cumsum(dim=0) - 1
    return last - per_row + 1, last


# ---------------------------------------------------------------------------------------------
# The entry point


def gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    *,
    impl: str = "auto",
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    normalize_qk: bool = True,
    doc_start: torch.Tensor | None = None,
    what: str = "impl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule by `impl`: (r (B, T, H, Dv) in v's dtype, final_state (B, H, Dv, Dk)).

    impl: `auto` (the Triton kernel on CUDA when triton is installed, else the reference), `triton`
    (the kernel, or an error saying why it cannot run), `reference` (reference.gated_delta_chunked in
    chunks of chunk_size; the kernel's chunk is fixed at 64) or `fla` (flash-linear-attention, if
    installed). `what` names the setting in error messages (the model passes its config key).
    doc_start (B, T) int zeroes the state before each document start (kernels/documents.py).
    Arguments otherwise as reference.gated_delta_chunked.
    """
    kwargs = {"initial_state": initial_state, "normalize_qk": normalize_qk, "doc_start": doc_start}
    if impl == "fla":
        return gated_delta_chunked_fla(q, k, v, log_gamma, beta, **kwargs)
    if backends.use_triton(impl, q.device, what):
        return gated_delta_chunked_triton(q, k, v, log_gamma, beta, **kwargs)
    return gated_delta_chunked(q, k, v, log_gamma, beta, chunk_size=chunk_size, **kwargs)
