"""The fused LM head + soft-capped cross-entropy (atma_titan.models.loss) against the plain logits path."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed_utils import TINY, losses, run_trainer
from helpers import SMALL
from torch.utils._python_dispatch import TorchDispatchMode

from atma_titan.config import ConfigError, load_config
from atma_titan.models.atma import SoftcapHead
from atma_titan.models.loss import (
    IGNORE_INDEX,
    LossTargets,
    add_product_,
    chunk_tokens_for,
    linear_softcap_cross_entropy,
    softcap,
)
from atma_titan.train import cross_entropy_sum, train


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Each test compiles from scratch: the graphs of earlier tests (other backends, other shapes) would
    otherwise count towards the recompile limit of the same functions in this process."""
    torch._dynamo.reset()
    yield


def make_case(b=2, t=13, d=8, vocab=23, *, dtype=torch.float64, bias=True, weighted=True, seed=0):
    """Random hidden states, a head with large enough weights that the cap bends the logits, labels with
    ignored positions, and per-label weights."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (3 * torch.randn(vocab, d, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    head_bias = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (b, t), generator=gen)
    labels.view(-1)[[2, labels.numel() // 2, -1]] = IGNORE_INDEX
    weights = torch.rand(b, t, generator=gen, dtype=torch.float64).to(torch.float32) * 3 + 0.5 if weighted else None
    return hidden, weight, head_bias, labels, weights


def plain_loss(hidden, weight, bias, labels, weights, cap):
    """The trainer's plain path: fp32 (here: the inputs' precision) logits, soft-capped, then summed CE."""
    logits = softcap(F.linear(hidden, weight, bias).to(torch.promote_types(hidden.dtype, torch.float32)), cap)
    return cross_entropy_sum(logits, labels, None if weights is None else weights.to(logits.dtype))


def params(case):
    hidden, weight, bias = case[:3]
    return [t for t in (hidden, weight, bias) if t is not None]


@pytest.mark.parametrize("cap", [0.0, 4.0])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 7, 26, 100])  # 26 tokens: 5 and 7 leave a remainder
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("weighted", [True, False])
def test_fused_equals_plain_loss_and_gradients_in_fp64(cap, chunk_tokens, bias, weighted):
    case = make_case(bias=bias, weighted=weighted)
    expected = plain_loss(*case, cap)
    expected_grads = torch.autograd.grad(expected * 0.37, params(case))  # a grad_output that is not 1
    fused = linear_softcap_cross_entropy(*case, cap=cap, chunk_tokens=chunk_tokens)
    grads = torch.autograd.grad(fused * 0.37, params(case))
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cap", [0.0, 15.0])
def test_fused_equals_plain_in_fp32(cap):
    case = make_case(t=40, d=16, vocab=97, dtype=torch.float32)
    expected = plain_loss(*case, cap)
    expected_grads = torch.autograd.grad(expected, params(case))
    fused = linear_softcap_cross_entropy(*case, cap=cap, chunk_tokens=11)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-4)
    for got, want in zip(torch.autograd.grad(fused, params(case)), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_bf16_parameters_get_bf16_gradients_close_to_the_plain_path():
    """As under FSDP2 with param_dtype bf16: matmuls in bf16, the cap and softmax in fp32."""
    case = make_case(t=64, d=32, vocab=101, dtype=torch.bfloat16)
    expected = plain_loss(*case, 15.0)
    expected_grads = torch.autograd.grad(expected, params(case))
    fused = linear_softcap_cross_entropy(*case, cap=15.0, chunk_tokens=24)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-3)
    for got, want in zip(torch.autograd.grad(fused, params(case)), expected_grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())


def test_all_labels_ignored_gives_zero_loss_and_zero_gradients():
    hidden, weight, bias, labels, weights = make_case()
    labels.fill_(IGNORE_INDEX)
    fused = linear_softcap_cross_entropy(hidden, weight, bias, labels, weights, cap=4.0, chunk_tokens=4)
    assert fused.item() == 0.0
    assert all(g.abs().max().item() == 0.0 for g in torch.autograd.grad(fused, [hidden, weight, bias]))


def test_without_gradients_only_the_loss_is_computed():
    case = make_case()
    with torch.no_grad():
        fused = linear_softcap_cross_entropy(*case, cap=4.0, chunk_tokens=5)
    assert fused.grad_fn is None
    torch.testing.assert_close(fused, plain_loss(*case, 4.0).detach(), rtol=1e-12, atol=1e-12)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_tokens_x_vocab_is_ever_made():
    b, t, d, vocab, chunk = 4, 64, 8, 50, 16
    case = make_case(b, t, d, vocab, dtype=torch.float32)
    with LargestTensor() as seen:
        loss = linear_softcap_cross_entropy(*case, cap=15.0, chunk_tokens=chunk)
        loss.backward()
    assert seen.largest == max(chunk * vocab, b * t * d, vocab * d)  # one chunk's logits at most
    with LargestTensor() as plain:
        plain_loss(*case, 15.0).backward()
    assert plain.largest == b * t * vocab


def test_chunk_size_bounds_the_fp32_logits():
    assert chunk_tokens_for(50_304, 256) == 1334  # 1334 x 50,304 x 4 bytes <= 256 MiB
    assert 1334 * 50_304 * 4 <= 256 * 2**20 < 1335 * 50_304 * 4
    assert chunk_tokens_for(50_304, 0.001) == 1  # always at least one token
    with pytest.raises(ValueError, match="chunk_mib"):
        chunk_tokens_for(512, 0)


def test_mismatched_labels_are_a_clear_error():
    hidden, weight, bias, labels, weights = make_case()
    with pytest.raises(ValueError, match="labels"):
        linear_softcap_cross_entropy(hidden, weight, bias, labels[:, :-1], cap=4.0)
    with pytest.raises(ValueError, match="loss weights"):
        linear_softcap_cross_entropy(hidden, weight, bias, labels, weights[:, :-1], cap=4.0)


def small_head(cap=4.0, d=8, vocab=23):
    torch.manual_seed(0)
    head = SoftcapHead(d, vocab, cap).double()
    with torch.no_grad():
        head.weight.mul_(10)
    return head


def head_grads(head, hidden, out):
    return torch.autograd.grad(out, [hidden, head.weight, head.bias])


@pytest.mark.parametrize(
    "backend",
    [None, pytest.param("aot_eager", marks=pytest.mark.slow), pytest.param("inductor", marks=pytest.mark.slow)],
)
def test_head_returns_the_loss_given_targets_also_compiled_with_fullgraph(backend):
    """The head's forward is the way in (FSDP2's hooks fire there); apply_compile compiles it with fullgraph,
    and the trainer compiles the chunk math with the same backend. New shapes and chunk budgets (dynamic
    shapes after the first recompilation) still give the plain path's numbers."""
    head = small_head()
    run = head if backend is None else torch.compile(head, fullgraph=True, backend=backend)
    for seed, (b, t, chunk) in enumerate([(2, 13, 5), (2, 13, 5), (3, 7, 4), (1, 9, 9)]):
        hidden, _, _, labels, weights = make_case(b, t, seed=seed)
        expected = plain_loss(hidden, head.weight, head.bias, labels, weights, head.cap)  # in fp64 throughout
        targets = LossTargets(labels, weights, chunk_mib=chunk * 23 * 4 / 2**20, compile_backend=backend)
        fused = run(hidden, targets)
        torch.testing.assert_close(fused, expected, rtol=1e-10, atol=1e-10)
        for got, want in zip(head_grads(head, hidden, fused), head_grads(head, hidden, expected)):
            torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(run(hidden), head(hidden))  # the logits path is unchanged


def test_autocast_runs_the_matmuls_in_the_autocast_dtype_as_the_linear_does():
    head = small_head().float()
    hidden, _, _, labels, weights = make_case(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = cross_entropy_sum(head(hidden), labels, weights)
        fused = head(hidden, LossTargets(labels, weights))
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-4)
    grads = head_grads(head, hidden, fused)
    assert [g.dtype for g in grads] == [torch.float32] * 3  # through the autocast casts, to the fp32 leaves
    for got, want in zip(grads, head_grads(head, hidden, expected)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_fsdp_mixed_precision_input_cast_leaves_the_loss_weights_in_fp32():
    """FSDP2 casts a module's floating-point inputs to param_dtype with this function; the weights inside
    LossTargets must come through unrounded."""
    from torch.distributed.utils import _apply_to_tensors

    labels, weights = torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), 1.3)
    to_bf16 = lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t  # noqa: E731 - FSDP's _cast_fp_tensor
    _, kwargs = _apply_to_tensors(to_bf16, ((torch.ones(2),), {"targets": LossTargets(labels, weights)}))
    assert kwargs["targets"].weights is weights  # untouched (as a tensor or in a dataclass it would be bf16)


# ---- the trainer's path ------------------------------------------------------------------------------


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def train_rows(folder: Path, *extra: str) -> list[dict]:
    base = ["--config", "train_configs/debug_model.toml", *SMALL, "--training.device", "cpu"]
    quiet = ["--checkpoint.enable", "false", "--metrics.stdout", "false"]
    train(load_config([*base, *quiet, "--job.dump_folder", str(folder), *extra]))
    return metrics(folder)


def assert_same_steps(fused: list[dict], plain: list[dict]) -> None:
    assert [r["step"] for r in fused] == [r["step"] for r in plain] == [1, 2, 3]
    for a, b in zip(fused, plain):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key)  # fp32 sums in another order
        # The distractor loss is small and reads q alone: after two steps, Muon's bf16 Newton-Schulz has turned
        # the gradients' fp32 rounding differences into bf16 ones in the update (2e-4 relative at step 3).
        assert a["distractor_loss"] == pytest.approx(b["distractor_loss"], rel=1e-3), a["step"]


@pytest.mark.slow
def test_training_steps_with_the_fused_loss_match_the_plain_loss(tmp_path):
    """Default fused loss, small chunks, recall weights and the distractor aux loss: loss and gradient norm
    of every step as with the plain logits + cross-entropy."""
    assert load_config([]).training.loss == "fused"
    common = ["--data.recall_weight", "5", "--model.distractor_weight", "0.01", "--training.loss_chunk_mib", "0.02"]
    fused = train_rows(tmp_path / "fused", *common)
    plain = train_rows(tmp_path / "plain", *common, "--training.loss", "plain")
    assert_same_steps(fused, plain)


@pytest.mark.slow
def test_compiled_training_with_the_fused_loss_matches_the_plain_loss(tmp_path):
    """The trainer's compiled path with inductor, as on the GPU (both backends compile the head above)."""
    common = ["--training.compile", "true", "--training.compile_backend", "inductor"]
    common += ["--model.distractor_weight", "0.01"]
    fused = train_rows(tmp_path / "fused", *common, "--training.loss_chunk_mib", "0.02")
    plain = train_rows(tmp_path / "plain", *common, "--training.loss", "plain")
    assert_same_steps(fused, plain)


@pytest.mark.parametrize(
    "flag, value, message",
    [("loss", "tanh", "choose one of: fused, plain"), ("loss_chunk_mib", "0", "a number > 0")],
)
def test_bad_loss_settings_are_config_errors(flag, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config([f"--training.{flag}", value])


@pytest.mark.slow
def test_fsdp_two_ranks_train_with_the_fused_loss_as_one_process_with_the_plain_loss(tmp_path):
    common = [*TINY, "--training.steps", "3", "--training.loss_chunk_mib", "0.02"]
    fused = run_trainer(2, *common, "--job.dump_folder", str(tmp_path / "fused"))
    assert fused.returncode == 0, fused.stdout[-3000:] + fused.stderr[-5000:]
    plain = run_trainer(1, *common, "--training.loss", "plain", "--job.dump_folder", str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stderr[-5000:]
    two, one = losses(tmp_path / "fused"), losses(tmp_path / "plain")
    assert list(two) == list(one) == [1, 2, 3]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step


def test_add_product_adds_in_place_where_the_matmul_cannot_accumulate():
    acc, a, b = torch.randn(5, 3), torch.randn(5, 4), torch.randn(4, 3)
    expected = acc + a @ b
    assert add_product_(acc, a, b) is acc
    torch.testing.assert_close(acc, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_add_product_accumulates_bf16_products_in_fp32_in_the_matmul():
    """The weight gradient's sum over chunks: in the matmul's fp32 epilogue, not rounded to bf16 per chunk."""
    torch.manual_seed(0)
    acc = torch.randn(256, 128, device="cuda")
    a, b = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in [(256, 512), (512, 128)])
    exact = acc.double() + a.double() @ b.double()
    got = acc.clone()
    assert add_product_(got, a, b) is got  # in place: no copy of acc into a new result
    assert torch.equal(got, torch.addmm(acc, a, b, out_dtype=torch.float32))  # the out-of-place sum, bit for bit
    rounded = acc + (a @ b).float()  # the per-chunk bf16 product the epilogue avoids
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() < 0.5 * (rounded.double() - exact).abs().max()
