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


def test_muon_equals_torch_muon_on_plain_tensors():
    from atma_titan.optim import Muon

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


def test_muon_batches_matrices_of_one_shape_and_matches_torch_muon(monkeypatch):
    from atma_titan import optim

    calls = []
    real = optim.orthogonalize
    monkeypatch.setattr(optim, "orthogonalize", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
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
    monkeypatch.setattr(optim, "orthogonalize", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
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
    monkeypatch.setattr(optim, "MAX_BATCH_ELEMENTS", 3 * 12 * 20)  # batches of 3, 3 and 1
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
