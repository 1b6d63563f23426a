"""The Polar block at initialisation, at the shapes and lengths of the small-scale reproduction (issue 20).

Measured on the repro (docs/model.md section 5): the null floor does not swamp the real keys at init,
and v_null = 0 keeps the null's weight out of the direction c altogether. What was out of scale is
how c reaches the zero-initialised W_o: as a unit vector, 8x below the memory's RMS-normalised
readout; model.polar_direction = "rms" (the default) gives it as sqrt(dk) c.
"""

from __future__ import annotations

import math

import pytest
import torch

from atma_titan.config import load_config
from atma_titan.kernels.polar.reference import polar_attention_naive
from atma_titan.models import resolve_model_args
from atma_titan.models.attention import GlobalAttention

REPRO = "train_configs/repro/polar_memory.toml"


def repro_block(memory: bool = True, direction: str = "rms") -> GlobalAttention:
    flags = [f"--model.memory={str(memory).lower()}", "--model.polar_direction", direction]
    args = resolve_model_args(load_config(["--config", REPRO, *flags]).model)
    torch.manual_seed(0)
    block = GlobalAttention(args)
    for module in block.modules():
        if module is not block and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    block.reset_polar_scalars()
    block.zero_output()
    return block


def w_o_input(block: GlobalAttention, x: torch.Tensor) -> torch.Tensor:
    seen = {}
    hook = block.o_proj.register_forward_hook(lambda m, i, o: seen.update(polar=i[0]))
    with torch.no_grad():
        block(x)
    hook.remove()
    return seen["polar"]


def init_scalars(block: GlobalAttention) -> tuple[torch.Tensor, ...]:
    return tuple(p.detach() for p in (block.len_gain, block.null_base, block.null_slope, block.mag_beta, block.v_null))


def test_direction_reaches_w_o_at_the_memory_readout_scale():
    """sqrt(dk) c * gate into W_o: unit RMS per component before the gate, as the memory's rms_norm(r)."""
    block = repro_block(memory=True)
    seen = {}
    block.o_proj.register_forward_hook(lambda m, i, o: seen.update(polar=i[0]))
    block.memory.proj.register_forward_hook(lambda m, i, o: seen.update(memory=i[0]))
    x = torch.randn(2, 128, block.args.d_model)
    with torch.no_grad():
        block(x)
        gate = block.project(x)[1]
    ungated = seen["polar"].view_as(gate) / torch.sigmoid(gate)
    rms = ungated.pow(2).mean(-1).sqrt()  # per head and position
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-4)
    ratio = seen["polar"].pow(2).mean().sqrt() / seen["memory"].pow(2).mean().sqrt()
    assert 0.67 < ratio < 1.5, f"Polar's W_o input is {ratio:.3f}x the memory's (a unit-norm c gives ~1/8)"


def test_the_paper_s_unit_direction_is_one_setting_away():
    """polar_direction = "unit" feeds W_o the unit c itself: sqrt(dk) times smaller, nothing else changes."""
    x = torch.randn(2, 128, repro_block().args.d_model)
    rms, unit = w_o_input(repro_block(direction="rms"), x), w_o_input(repro_block(direction="unit"), x)
    torch.testing.assert_close(rms, unit * math.sqrt(repro_block().args.head_dim))
    assert resolve_model_args(load_config([]).model).polar_direction == "rms"  # the default


def test_null_weight_does_not_dim_the_direction_at_init():
    """With v_null = 0 (its init) c is the normalised read of the real keys alone: the null floor only
    changes mag, however much mass it takes."""
    block = repro_block(memory=False)
    len_gain, null_base, null_slope, mag_beta, v_null = init_scalars(block)
    assert torch.count_nonzero(v_null) == 0
    q, _, k, v, _ = block.project(torch.randn(2, 128, block.args.d_model))
    q, k, v = (t.detach().double() for t in (q, k, v))
    c0, mag0 = polar_attention_naive(q, k, v, len_gain, null_base, null_slope, mag_beta, v_null)
    c1, mag1 = polar_attention_naive(q, k, v, len_gain, null_base + 4.0, null_slope, mag_beta, v_null)
    torch.testing.assert_close(c0, c1)
    assert (mag1 < mag0).all()


@pytest.mark.parametrize("n", [8, 32, 128, 512, 4096])  # the repro's training length and its eval gaps
def test_real_keys_compete_with_the_null_at_init(n):
    """Noise keys hold a share of the mass at the training lengths, and one matching key takes >= 90%
    of it at every length up to 32x: the floor rejects noise without shutting real keys out."""
    block = repro_block(memory=False)
    len_gain, null_base, null_slope, mag_beta, v_null = init_scalars(block)
    h, d = block.args.n_heads, block.args.head_dim
    gen = torch.Generator().manual_seed(n)

    def unit_rms(t):
        return t / t.pow(2).mean(-1, keepdim=True).sqrt()

    q = unit_rms(torch.randn(4, 1, h, d, generator=gen, dtype=torch.float64))
    k = unit_rms(torch.randn(4, n, 1, d, generator=gen, dtype=torch.float64))
    v = torch.randn(4, n, 1, d, generator=gen, dtype=torch.float64)

    def real_mass(keys):
        """The weights of docs/model.md section 3.3 for query head 0's single query, and 1 - w_N."""
        s = torch.einsum("bqhd,bkd->bhqk", q, keys[:, :, 0]) / math.sqrt(d)
        temp = 1 + torch.nn.functional.softplus(len_gain) * math.log(n)
        null = null_base + torch.nn.functional.softplus(null_slope) * math.sqrt(math.log1p(n))
        logits = torch.cat([temp[None, :, None, None] * s, (temp * null)[None, :, None, None].expand(4, h, 1, 1)], -1)
        weights = logits.softmax(-1)
        return weights, 1 - weights[..., -1]

    _, noise_mass = real_mass(k)
    if n <= 128:
        assert noise_mass.mean() > 0.05, f"n={n}: the null takes {1 - noise_mass.mean():.3f} of the mass"
    matched = k.clone()
    matched[:, n // 2, 0] = q[:, 0, 0]  # query head 0 finds its own vector in the middle of the context
    weights, _ = real_mass(matched)
    assert (weights[:, 0, 0, n // 2] > 0.9).all()
    # the same softmax as the reference's naive form: the matched key wins there too
    c, _ = polar_attention_naive(q, matched, v, len_gain, null_base, null_slope, mag_beta, v_null)
    cos = torch.nn.functional.cosine_similarity(c[:, 0, 0], v[:, n // 2, 0], dim=-1)
    assert (cos > 0.9).all()
