import math

import pytest
import torch
import torch.nn.functional as F

from atma_titan.config import JobConfig, load_config
from atma_titan.models import ATMA, parameter_breakdown, resolve_model_args
from atma_titan.models.atma import softcap
from atma_titan.models.attention import GlobalAttention
from atma_titan.models.conv import GatedShortConv
from atma_titan.optim import build_optimizers
from atma_titan.models import build_model
from atma_titan.train import main


def model_for(*overrides: str, seed: int = 0) -> ATMA:
    cfg = load_config(list(overrides))
    cfg.job.seed = seed
    return build_model(resolve_model_args(cfg.model), torch.device("cpu"), seed=cfg.job.seed)


def test_370m_dry_run_prints_exact_parameter_count(capsys):
    assert main(["--config", "train_configs/atma_370m.toml", "--job.dry_run", "true"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 378,220,864" in out
    assert main(["--config", "train_configs/atma_370m.toml", "--job.dry_run", "true", "--model.memory", "false"]) == 0
    assert "parameters: 369,758,464" in capsys.readouterr().out


def test_370m_components_match_the_paper_on_meta_device():
    with torch.device("meta"):
        model = ATMA(resolve_model_args(load_config(["--model.flavor", "atma_370m"]).model))
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    counts = parameter_breakdown(model)
    assert counts["embedding"] == 51_511_296 and counts["lm_head"] == 51_561_600
    assert counts["norms"] == 33_792 and counts["mlp"] == 16 * 12_592_128
    assert counts["conv_blocks"] == 12 * 4_201_472
    assert counts["attention_blocks"] == 4 * 3_690_016 and counts["memory"] == 4 * 2_115_600
    assert [i for i, b in model.blocks.items() if b.is_global] == ["2", "6", "10", "14"]


def test_init_zeroes_residual_outputs_but_not_conv_in_proj():
    model = model_for("--model.global_layers", "1,3")
    zeroed = [model.head.weight, model.head.bias]
    for block in model.blocks.values():
        zeroed += [block.mlp.proj.weight, block.mlp.proj.bias]
        if isinstance(block.mixer, GatedShortConv):
            zeroed.append(block.mixer.out_proj.weight)
            assert block.mixer.in_proj.weight.abs().sum() > 0
        else:
            zeroed += [block.mixer.o_proj.weight, block.mixer.mu_proj.weight, block.mixer.memory.proj.weight]
            assert torch.allclose(F.softplus(block.mixer.len_gain), torch.tensor(math.log1p(math.exp(-1.0))))
            assert (block.mixer.null_base == 2.0).all() and (block.mixer.v_null == 0).all()
    assert all((p == 0).all() for p in zeroed)


def test_same_seed_same_weights_different_seed_different():
    a, b, c = model_for(seed=3), model_for(seed=3), model_for(seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.blocks["0"].mixer.in_proj.weight, c.blocks["0"].mixer.in_proj.weight)


def train_steps(model: ATMA, steps: int, T: int = 32, B: int = 2, **opt_overrides) -> list[float]:
    cfg = JobConfig()
    for k, v in opt_overrides.items():
        setattr(cfg.optimizer, k, v)
    optimizers = build_optimizers(model, cfg.optimizer)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, model.args.vocab_size, (B, T + 1), generator=gen)
        logits, aux = model(tokens[:, :-1], return_aux=True)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        (loss if aux is None else loss + aux).backward()
        optimizers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
    return losses


def test_every_conv_block_trains_in_and_out_proj():
    model = model_for()
    before = {
        n: p.detach().clone() for n, p in model.named_parameters() if "mixer.in_proj" in n or "mixer.out_proj" in n
    }
    assert len(before) == 2 * 3 * 2  # weight + bias of in/out proj in the 3 conv blocks
    train_steps(model, 3)
    after = dict(model.named_parameters())
    for name, value in before.items():
        if name.endswith("weight"):
            assert not torch.equal(after[name], value), f"{name} did not move"


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["--model.attention", "softmax"],
        ["--model.attention", "softmax", "--model.position", "rope"],
        ["--model.position", "rope"],
        ["--model.memory", "false"],
        ["--model.window", "8"],
        ["--model.attention", "softmax", "--model.window", "8"],
        ["--model.distractor_weight", "0.01"],
        ["--model.gamma_max", "0.99"],
        ["--model.canon", "false"],
        ["--model.global_layers", "all"],
        ["--model.global_layers", "[]"],
        ["--model.mlp", "swiglu"],
        ["--model.logit_softcap", "0"],
        ["--optimizer.name", "adamw"],
    ],
    ids=lambda o: "-".join(x.lstrip("-").replace("model.", "") for x in o) or "default",
)
def test_every_ablation_switch_builds_and_trains(overrides):
    model = model_for(*overrides)
    opt = {"name": "adamw"} if "--optimizer.name" in overrides else {}
    losses = train_steps(model, 2, **opt)
    assert all(math.isfinite(x) for x in losses)
    kinds = {type(b.mixer) for b in model.blocks.values()}
    if "all" in overrides:
        assert kinds == {GlobalAttention}
    if "[]" in overrides:
        assert kinds == {GatedShortConv}


def test_distractor_loss_is_reported_and_differentiable():
    model = model_for("--model.distractor_weight", "0.01")
    model.train()
    _, aux = model(torch.randint(0, 512, (2, 16)), return_aux=True)
    assert aux is not None and 0 < aux.item() < 0.01
    aux.backward()
    glob = next(b for b in model.blocks.values() if b.is_global).mixer
    assert glob.null_base.grad.abs().sum() > 0  # the null floor learns to beat noise keys
    model.eval()
    assert model(torch.randint(0, 512, (2, 16)), return_aux=True)[1] is None


@pytest.mark.parametrize(
    "overrides", [[], ["--model.attention", "softmax", "--model.position", "rope"], ["--model.window", "5"]]
)
def test_causal_future_tokens_do_not_change_the_past(overrides):
    model = model_for(*overrides)
    for p in model.parameters():  # give the zero-initialised outputs some weight
        if (p == 0).all():
            torch.nn.init.normal_(p, std=0.05)
    tokens = torch.randint(0, 512, (1, 24))
    changed = tokens.clone()
    changed[0, 15:] = torch.randint(0, 512, (9,))
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :15], b[0, :15], atol=1e-5)
    assert not torch.allclose(a[0, 15:], b[0, 15:])


def test_causal_depthwise_conv_matches_conv1d():
    from atma_titan.models.layers import CausalDepthwiseConv

    for kernel in (3, 4):
        conv = CausalDepthwiseConv(6, kernel)
        x = torch.randn(2, 9, 6, dtype=torch.float64)
        w = conv.weight.detach().double()
        expected = F.conv1d(F.pad(x.transpose(1, 2), (kernel - 1, 0)), w.unsqueeze(1), groups=6).transpose(1, 2)
        assert torch.allclose(conv.double()(x), expected)


def test_softcap_is_bounded_and_near_identity():
    z = torch.tensor([-1e4, -1.0, 0.0, 0.5, 1e4])
    out = softcap(z, 15.0)
    assert out.abs().max() < 15.0 and torch.allclose(out[1:4], z[1:4], atol=1e-2)
    assert torch.equal(softcap(z, 0), z)


def test_head_output_is_fp32_under_bf16_autocast():
    model = model_for()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.randint(0, 512, (1, 8)))
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("memory", ["true", "false"])
def test_a_global_block_projects_its_input_in_one_matrix_product(memory):
    """q, k, v and the memory's gates of x: one matrix product reads x, and the outputs and x's gradient are
    those of each projection on its own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from atma_titan.models.layers import fused_linear

    torch.manual_seed(0)
    model = model_for("--model.flavor", "debug", "--model.memory", memory)
    block = next(b.mixer for b in model.blocks.values() if b.is_global)
    x = torch.randn(2, 16, model.args.d_model, requires_grad=True)

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reading_x = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                mats = args[1:] if func is torch.ops.aten.addmm.default else args
                self.reading_x += any(m.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for m in mats)
            return func(*args, **(kwargs or {}))

    with Products() as products:
        block.project(x)
    assert products.reading_x == 1

    linears = [block.q_proj, block.k_proj, block.v_proj, *(block.memory.input_projections() if block.memory else [])]
    assert len(linears) == (6 if memory == "true" else 3)
    fused = fused_linear(x, linears)
    probes = [torch.randn_like(y) for y in fused]
    (gx_fused,) = torch.autograd.grad(sum((y * p).sum() for y, p in zip(fused, probes)), x)
    apart = [linear(x) for linear in linears]
    (gx_apart,) = torch.autograd.grad(sum((y * p).sum() for y, p in zip(apart, probes)), x)
    for y, z in zip(fused, apart):
        torch.testing.assert_close(y, z)
    torch.testing.assert_close(gx_fused, gx_apart)
