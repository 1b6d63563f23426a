import math

import pytest
import torch
from torch import nn

from atma_titan.config import JobConfig, LRScheduler
from atma_titan.optim import build_optimizers, lr_factor, split_parameters
from atma_titan.models import build_model, resolve_model_args


def test_parameter_groups_follow_the_recipe():
    cfg = JobConfig()
    model = build_model(resolve_model_args(cfg.model), torch.device("cpu"), seed=cfg.job.seed)
    groups = split_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sum(len(g) for g in groups.values()) == len(list(model.parameters()))
    assert all(p.ndim >= 2 and names[id(p)].startswith("blocks.") for p in groups["matrix"])
    assert all(p.ndim == 1 for p in groups["scalar"])
    assert [names[id(p)] for p in groups["embed"]] == ["embed.weight"]
    assert sorted(names[id(p)] for p in groups["head"]) == ["head.bias", "head.weight"]
    # Conv kernels and v_null are block matrices too: Muon takes them.
    matrix_names = {names[id(p)] for p in groups["matrix"]}
    assert "blocks.0.mixer.conv.weight" in matrix_names and "blocks.2.mixer.v_null" in matrix_names

    opts = build_optimizers(model, JobConfig().optimizer)
    muon, adam = opts.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adam, torch.optim.AdamW)
    lrs = {g["name"]: g["lr"] for g in opts.param_groups}
    assert lrs == {"matrix": 0.02, "embed": 0.3, "head": 1 / 320, "scalar": 0.01}
    assert adam.defaults["betas"] == (0.8, 0.95) and adam.defaults["eps"] == 1e-10


def test_constant_then_linear_schedule():
    f = lr_factor(LRScheduler(name="constant_then_linear", decay_start=0.3), 100)
    assert [f(i) for i in (0, 29)] == [1.0, 1.0]
    assert f(30) == 1.0 and f(65) == pytest.approx(0.5)
    assert 0 < f(99) < 0.02
    values = [f(i) for i in range(100)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_warmup_cosine_schedule():
    f = lr_factor(LRScheduler(name="warmup_cosine", warmup_steps=10, min_lr_ratio=0.1), 110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)


def test_muon_equals_torch_muon_on_plain_tensors(monkeypatch):
    """With its products in bf16, as on a GPU, Muon is torch.optim.Muon bit for bit (the CPU's default is fp32)."""
    import functools

    from atma_titan import optim
    from atma_titan.optim import Muon

    orthogonalize_in_bf16 = functools.partial(optim.orthogonalize, compute_dtype=torch.bfloat16)
    monkeypatch.setattr(optim.newton_schulz, "orthogonalize", orthogonalize_in_bf16)
    torch.manual_seed(0)
    weights = [torch.randn(16, 8), torch.randn(4, 12), torch.randn(32, 3)]
    ours = [w.clone().requires_grad_() for w in weights]
    ref = [w.clone().requires_grad_() for w in weights]
    opt_ours = Muon(ours, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    opt_ref = torch.optim.Muon(ref, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    for _ in range(3):
        grads = [torch.randn_like(w) for w in weights]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_ref.step()
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)


def test_on_the_cpu_newton_schulz_multiplies_in_fp32_and_returns_bf16():
    """bf16 matrix products have no fast CPU kernel on most machines; the result is bf16 either way."""
    from atma_titan import optim

    torch.manual_seed(0)
    x = torch.randn(3, 24, 40)
    default = optim.orthogonalize(x, 5)
    assert default.dtype == torch.bfloat16
    assert torch.equal(default, optim.orthogonalize(x, 5, compute_dtype=torch.float32))
    in_bf16 = optim.orthogonalize(x, 5, compute_dtype=torch.bfloat16)
    assert not torch.equal(default, in_bf16)
    torch.testing.assert_close(default.float(), in_bf16.float(), atol=3e-2, rtol=0)


def test_muon_batches_matrices_of_one_shape_and_matches_torch_muon(monkeypatch):
    from atma_titan import optim

    calls = []
    real = optim.orthogonalize
    monkeypatch.setattr(optim.newton_schulz, "orthogonalize", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    torch.manual_seed(0)
    weights = [torch.randn(48, 40) for _ in range(5)] + [torch.randn(40, 48) for _ in range(2)] + [torch.randn(8, 3)]
    ours = [w.clone().requires_grad_() for w in weights]
    ref = [w.clone().requires_grad_() for w in weights]
    opt_ours = optim.Muon(ours, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    opt_ref = torch.optim.Muon(ref, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    for _ in range(3):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt_ours.step()
        opt_ref.step()
    # One Newton-Schulz per shape, each matrix as it lies (tall ones are not turned), a lone small matrix padded.
    assert calls[:3] == [(5, 48, 40), (2, 40, 48), (1, *optim.SMALL_MATRIX)]
    for p, q in zip(ours, ref):  # bf16 Newton-Schulz: batched and one-by-one products round alike but not bit-equal
        torch.testing.assert_close(p, q, atol=2e-3, rtol=0)


def test_small_matrices_share_one_zero_padded_batch_and_keep_their_own_results(monkeypatch):
    """Launch-bound small matrices (conv kernels, gate rows) are padded to one shape: one Newton-Schulz for all."""
    from atma_titan import optim

    calls = []
    real = optim.orthogonalize
    monkeypatch.setattr(optim.newton_schulz, "orthogonalize", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    torch.manual_seed(0)
    updates = [torch.randn(8, 3), torch.randn(3, 8), torch.randn(20, 100), torch.randn(1, 5), torch.randn(64, 40)]
    done = optim.orthogonalize_all(updates, 5, 1e-7)
    assert calls == [(4, *optim.SMALL_MATRIX), (1, 64, 40)]
    for u, x in zip(updates, done):
        assert x.shape == u.shape
        torch.testing.assert_close(x.float(), real(u, 5).float(), atol=1e-2, rtol=0)


def test_tall_matrices_are_orthogonalized_as_they_lie_and_come_back_contiguous_bf16(monkeypatch):
    """A transposing copy of the large tall matrices (8192 x 1024 MLP inputs) in and out of the batch cost more
    GPU time than their products: a tall matrix is iterated on x^T x from the right instead, and its result is a
    contiguous bf16 matrix the parameter's own shape (added to the fp32 shard without another cast)."""
    from atma_titan import optim

    torch.manual_seed(0)
    copied = []
    real_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: copied.extend(src) or real_copy(dst, src))
    tall, wide = torch.randn(3, 96, 40), torch.randn(40, 96)
    done = optim.orthogonalize_all([*tall, wide], 5, 1e-7)
    assert len(copied) == 4 and all(src.is_contiguous() for src in copied)  # no transposed view goes into a batch
    for u, x in zip([*tall, wide], done):
        assert x.shape == u.shape and x.dtype == torch.bfloat16 and x.is_contiguous()
    # The same map as the wide iteration on the transpose (bf16 products: close, not bit-equal).
    for u, x in zip(tall, done):
        torch.testing.assert_close(x.float(), optim.orthogonalize(u.T.contiguous(), 5).T.float(), atol=2e-2, rtol=0)
        singular = torch.linalg.svdvals(x.double())
        assert 0.6 < singular.min() and singular.max() < 1.3  # Newton-Schulz's band around 1


def test_orthogonalize_all_caps_the_stacked_memory(monkeypatch):
    from atma_titan import optim

    torch.manual_seed(0)
    updates = [torch.randn(12, 20) for _ in range(7)]
    whole = optim.orthogonalize_all(updates, 5, 1e-7)
    monkeypatch.setattr(optim.newton_schulz, "MAX_BATCH_ELEMENTS", 3 * 12 * 20)  # batches of 3, 3 and 1
    capped = optim.orthogonalize_all(updates, 5, 1e-7)
    for u, w, c in zip(updates, whole, capped):
        torch.testing.assert_close(c.float(), w.float(), atol=1e-2, rtol=0)
        torch.testing.assert_close(c.float(), optim.orthogonalize(u, 5).float(), atol=1e-2, rtol=0)


def test_muon_runs_its_foreach_ops_on_local_shards_not_dtensors(one_rank_gloo):
    """DTensor dispatches a foreach op tensor by tensor on the host (the one-micro-batch step waited
    for it on the H200), and torch 2.11 has sharding rules for in-place foreach lerp only: Muon's
    element-wise work goes to the local shards instead."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from atma_titan.optim import Muon

    class RecordDTensorOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (1,))
    params = [nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])) for _ in range(3)]
    for p in params:
        p.grad = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])
    opt = Muon(params, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    with RecordDTensorOps() as record:
        opt.step()
    assert not {op for op in record.ops if op.startswith("_foreach")}, record.ops
    assert all(torch.isfinite(p.to_local()).all() for p in params)


def _muon_and_fused_adamw(device: str = "cpu"):
    from atma_titan.optim import Muon, Optimizers

    torch.manual_seed(0)
    matrices = [nn.Parameter(torch.randn(16, 8, device=device)) for _ in range(2)]
    matrices.append(nn.Parameter(torch.randn(4, 12, device=device)))
    vectors = [nn.Parameter(torch.randn(8, device=device)), nn.Parameter(torch.randn(5, device=device))]
    muon = Muon(matrices, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
    adam = torch.optim.AdamW(vectors, lr=0.01, betas=(0.8, 0.95), fused=True)  # found_inf works on CPU too
    return Optimizers([muon, adam]), matrices + vectors


def _state(optimizers, params) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in params]
    for opt in optimizers.optimizers:
        for state in opt.state.values():
            tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_optimizers_queue_the_whole_step_before_asking_and_a_skip_changes_nothing(monkeypatch, device):
    """The trainer asks (allowed) only after Muon and a fused AdamW, both deciding on the device, are queued
    whole, so the GPU works while the host reads the loss; a skip leaves every parameter and state as it
    was (NaN gradients included), a go equals a plain step."""
    from atma_titan import optim

    events = []
    real = optim.muon.apply_updates_
    monkeypatch.setattr(optim.muon, "apply_updates_", lambda *a, **k: events.append("muon update") or real(*a, **k))
    ours, params = _muon_and_fused_adamw(device)
    ref, ref_params = _muon_and_fused_adamw(device)
    for step in range(4):
        go = step != 2  # the third step is skipped (a non-finite loss under nan_policy = "skip")
        grads = [torch.randn_like(p) for p in params]
        for p, q, g in zip(params, ref_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if not go:
            for p in params:
                p.grad[0] = float("nan")
        before = _state(ours, params)
        adam_steps = [s["step"].item() for s in ours.optimizers[1].state.values()]
        events.clear()

        def allowed():
            events.append("asked")
            # AdamW has run already, deciding on the device: it moved only when the step goes ahead.
            moved = not torch.equal(params[3].detach(), before[3])
            assert moved == go and len(ours.optimizers[1].state) == 2
            return go

        assert ours.step(allowed, skip=torch.tensor(0.0 if go else 1.0, device=device)) is go
        assert events == ["muon update", "asked"]
        if go:
            ref.step()
            for a, b in zip(_state(ours, params), _state(ref, ref_params)):
                assert torch.equal(a, b)
        else:
            after = _state(ours, params)
            assert all(torch.equal(a, b) for a, b in zip(after, before))  # parameters, momenta, moments
            assert [s["step"].item() for s in ours.optimizers[1].state.values()] == adam_steps
            for p, q in zip(params, ref_params):  # the reference skips by not stepping
                q.grad = None


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipping, and a coefficient of exactly 1
def test_the_clip_folded_into_the_optimizers_equals_clipping_the_gradients_first(device, max_norm):
    """Optimizers.step(grad_scale=c) (Muon reads c in its kernel, AdamW's gradients are scaled in one pass)
    gives the parameters and states of clip_grads_ followed by a plain step: bit for bit on the CPU; on a
    GPU the kernel may fuse the scale into the momentum's multiply-add, one fp32 rounding fewer, so the
    momenta agree to fp32 rounding and the parameters to a bf16 rounding of a Newton-Schulz input."""
    from atma_titan.parallel import clip_coefficient, clip_grads_, total_norm

    ours, params = _muon_and_fused_adamw(device)
    ref, ref_params = _muon_and_fused_adamw(device)
    for _ in range(3):
        for p, q in zip(params, ref_params):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        norm = total_norm([p.grad for p in params])
        clip_grads_([q.grad for q in ref_params], max_norm, norm)
        ref.step()
        assert ours.step(skip=torch.tensor(0.0, device=device), grad_scale=clip_coefficient(norm, max_norm))
        for a, b in zip(_state(ours, params), _state(ref, ref_params)):
            if device == "cpu":
                assert torch.equal(a, b)
            else:  # a wrong scale is off by the clip's factor of ~2; a rounding by far less
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_optimizers_without_a_device_skip_step_only_after_a_yes():
    ours, params = _muon_and_fused_adamw()
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    asked = []
    assert not ours.step(lambda: asked.append(len(ours.optimizers[1].state)) or False)
    assert asked == [0]  # AdamW had not stepped when asked; nor after the no
    assert not ours.optimizers[1].state and all(torch.equal(p, b) for p, b in zip(params, before))
    assert not ours.optimizers[0].state  # nor Muon


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_to_host_waits_for_its_copy_not_for_the_work_queued_after_it():
    """The trainer reads the step's loss this way after queueing Newton-Schulz: .tolist() would wait for that."""
    from atma_titan.utils.device import copy_to_host

    values = torch.tensor([1.5, float("nan")], device="cuda")
    read = copy_to_host(values)
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(10):  # hundreds of ms of fp32 products, queued after the copy
        x = torch.tanh(x @ x)
    queued_work_done = torch.cuda.Event()
    queued_work_done.record()
    first, second = read()
    assert not queued_work_done.query()  # the host has its values while the GPU still works
    assert first == 1.5 and math.isnan(second)
    torch.cuda.synchronize()


def test_lr_schedules_see_every_optimizer_step_through_the_device_decided_path():
    """torch's LR scheduler warns when its step comes before the optimizer's step() (CI caught it once:
    a staged Muon bypassed step())."""
    import warnings

    from atma_titan.optim import LRSchedules

    ours, params = _muon_and_fused_adamw()
    schedules = LRSchedules(ours, LRScheduler(name="constant_then_linear", decay_start=0.5), 10)
    for p in params:
        p.grad = torch.randn_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ours.step(lambda: True, skip=torch.tensor(0.0))
        schedules.step()
    assert all(opt._opt_called for opt in ours.optimizers)
