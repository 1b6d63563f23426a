"""The induction needle, teacher-forced or generated (docs/model.md section 7).

Protocol, one trial::

    [EOT] + " The access code for record {R} is" + " d d d d d" + haystack[:gap]
          + " The access code for record {R} is" + " d d d d d"

R is a 7-digit record number and d d d d d a 5-digit value, both drawn per trial from
`np.random.default_rng((seed, trial))`, so trial i carries the same record and value at every gap,
depth and variant. Each text piece is tokenised on its own and the token lists are concatenated:
the EOT id, the cue, each " d" of the value, the haystack tokens; so the layout is exact, and
`gap` counts haystack TOKENS. The model reads the sequence minus its last token; at the 5 value
digits of the query it is scored by per-digit greedy accuracy (argmax == digit token), exact 5/5
accuracy and mean cross-entropy (nats).

* Control: the same sequence with the first cue + value removed and the haystack continued by as
  many tokens, so it has the same length and the query sits at the same positions. Its CE is what
  the model does with no needle to copy (about log 10 for a model that knows a digit comes).
* Depth (0.1 / 0.5 / 0.9): the first cue + value goes at that fraction of the haystack instead of
  before it (`haystack[:k] + needle + haystack[k:gap]`, k = round(depth * gap)); the query stays at
  the end. Depth 0 (or None) is the protocol's layout above.
* Passkey: the cue is " The pass key is" (no record number), in the needle and in the query.

Digits. The protocol writes each value digit as " d" and scores one greedy prediction per digit,
so each digit must be one token. Two kinds of tokenizer qualify (`digit_tokens`):

* " d" is a single token (GPT-2 BPE has one token for each of " 0" .. " 9"): that token is scored;
* " d" is a space token followed by a single digit token, exactly the tokens of " " then "d"
  (the byte tokenizer: b" " then b"3"): the space is fed as context and the digit token is the
  scored one. This keeps the text identical to the protocol; the model is asked for the digit
  right after it has seen the space, which is the same decision as predicting " d" in one token.

Any other split (e.g. " 3" -> [" ", "3" split again], or a digit merged with the space into two
unrelated pieces) raises `EvalInputError` naming the digit and its tokens.

Generated (`generate=True`, the eval command's --generate). The model reads the needle sequence up to
the query's value (everything before its first value token) and writes the value greedily, free-running,
with the generation engine's cache (`atma_titan.inference.Generator`, no EOT stop): as many new tokens as
the value has (with the byte tokenizer the spaces too, 10 tokens for 5 digits). Digit accuracy is the
fraction of digits whose generated token at the digit's place (the `DigitTokens.encode` offsets) is the
digit; exact accuracy the fraction of trials whose whole generated value is the expected tokens (spaces
included). There is no CE and no control (`ce` and `control_ce` are None); the rows say
`mode = "generated"`, teacher-forced ones `mode = "teacher_forced"`. While the generated prefix is right,
each generated token is the teacher-forced argmax at that place (up to rounding: cached decoding and a
full forward may break a near-tie differently in bf16), so the two modes part only at the model's first
mistake: teacher forcing feeds the true token and goes on, generation continues from its own.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from atma_titan.eval.common import EvalInputError, size_label
from atma_titan.inference.context import evaluating, pad_right
from atma_titan.eval.corpus import FillerHaystack

__all__ = [
    "ACCESS_CUE",
    "GENERATED",
    "PASSKEY_CUE",
    "TEACHER_FORCED",
    "VARIANTS",
    "DigitTokens",
    "NeedleResult",
    "NeedleTrial",
    "build_needle",
    "digit_tokens",
    "evaluate_needle",
    "generate_greedy",
    "generated_scores",
    "haystack_tokens_needed",
    "needle_cue",
    "quick_needle",
    "run_needle",
    "sample_needle",
    "score_batch",
    "score_generated",
]

ACCESS_CUE = " The access code for record {record} is"
PASSKEY_CUE = " The pass key is"
VARIANTS = ("access", "passkey")
VALUE_DIGITS = 5
RECORD_DIGITS = 7
# Haystack tokens asked for beyond the gap: the control continues the haystack by the length of the
# cue + value (~15 GPT-2 tokens, 48 bytes). A fixed margin keeps the choice of documents per gap
# the same for every trial.
NEEDLE_SLACK = 128
DEFAULT_BATCH_TOKENS = 1 << 17  # tokens per forward pass: 2 sequences at 64K, 64 at 2K
TEACHER_FORCED, GENERATED = "teacher_forced", "generated"  # the `mode` of a result row


# ---------------------------------------------------------------------------------------------
# Digits
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DigitTokens:
    """How the value digits are written and scored for one tokenizer.

    `pieces[d]` are the tokens of " d" (what is fed); `scored[d]` is the token predicted and
    scored: the whole piece for a single-token " d", the digit after the space otherwise.
    """

    pieces: tuple[tuple[int, ...], ...]
    scored: tuple[int, ...]

    @property
    def space_separate(self) -> bool:
        return len(self.pieces[0]) > 1

    def encode(self, digits: Sequence[int]) -> tuple[list[int], list[int]]:
        """Tokens of " d1 d2 ..." and the offsets (within them) of the scored digit tokens."""
        tokens, offsets = [], []
        for d in digits:
            tokens += self.pieces[d]
            offsets.append(len(tokens) - 1)
        return tokens, offsets


def _show(tokenizer, ids: Sequence[int]) -> str:
    return "[" + ", ".join(f"{i} {tokenizer.decode([i])!r}" for i in ids) + "]"


def digit_tokens(tokenizer) -> DigitTokens:
    """Check that every " d" is one token, or a space token plus one digit token; raise otherwise."""
    space = list(tokenizer.encode(" "))
    pieces, scored, kinds = [], [], set()
    for d in range(10):
        piece = list(tokenizer.encode(f" {d}"))
        alone = list(tokenizer.encode(str(d)))
        if len(piece) == 1:
            kinds.add("single")
        elif len(alone) == 1 and piece == space + alone:
            kinds.add("space+digit")
        else:
            raise EvalInputError(
                f"tokenizer {getattr(tokenizer, 'name', tokenizer)!r}: the value digit ' {d}' encodes to "
                f"{len(piece)} tokens {_show(tokenizer, piece)} (and '{d}' alone to {_show(tokenizer, alone)}). "
                "The induction needle scores one greedy prediction per digit, so ' d' must be a single token "
                "(as in GPT-2 BPE) or a space token followed by a single digit token (as in the byte tokenizer); "
                "use a tokenizer whose digits are single tokens"
            )
        pieces.append(tuple(piece))
        scored.append(piece[-1])
    if len(kinds) > 1:
        raise EvalInputError(
            f"tokenizer {getattr(tokenizer, 'name', tokenizer)!r} writes some digits ' d' as one token and others "
            "as a space plus a digit; the needle needs one scheme for all ten so every trial has the same layout"
        )
    if len(set(scored)) != 10:
        raise EvalInputError(f"tokenizer {getattr(tokenizer, 'name', tokenizer)!r}: the ten digits share tokens")
    return DigitTokens(tuple(pieces), tuple(scored))


# ---------------------------------------------------------------------------------------------
# Building one trial
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NeedleTrial:
    """One trial's sequences. The model reads `tokens[:-1]`; `targets` index `tokens`."""

    tokens: np.ndarray  # the needle sequence, ending with the query's value
    control: np.ndarray  # same length, the first cue + value removed, haystack continued
    targets: np.ndarray  # positions of the 5 scored digit tokens of the query (same in both)
    target_ids: np.ndarray  # the scored digit token at each target position
    needle_at: int  # position of the first cue's first token in `tokens`
    query_at: int  # position of the query cue's first token
    value_at: int  # position of the query's first value token: `tokens[:value_at]` is the generation prompt

    @property
    def value(self) -> np.ndarray:
        """The query's value tokens (what generation must write)."""
        return self.tokens[self.value_at :]

    @property
    def value_offsets(self) -> np.ndarray:
        """The scored digit tokens' offsets within `value`."""
        return self.targets - self.value_at


def sample_needle(seed: int, trial: int) -> tuple[int, tuple[int, ...]]:
    """(7-digit record number, 5 value digits) of trial `trial`: the same at every gap, depth and variant."""
    rng = np.random.default_rng((seed, trial))
    record = int(rng.integers(10 ** (RECORD_DIGITS - 1), 10**RECORD_DIGITS))
    return record, tuple(int(d) for d in rng.integers(0, 10, size=VALUE_DIGITS))


def needle_cue(variant: str, record: int) -> str:
    if variant == "access":
        return ACCESS_CUE.format(record=record)
    if variant == "passkey":
        return PASSKEY_CUE
    raise EvalInputError(f"unknown needle variant {variant!r}; allowed: {', '.join(VARIANTS)}")


def haystack_tokens_needed(gap: int) -> int:
    """Haystack tokens to fetch for one trial at `gap` (the control needs a few beyond it)."""
    return gap + NEEDLE_SLACK


def _depth_offset(depth: float | None, gap: int) -> int:
    depth = depth or 0.0
    if not 0.0 <= depth < 1.0:
        raise EvalInputError(f"needle depth must be in [0, 1), got {depth}")
    return int(round(depth * gap))


def build_needle(
    tokenizer,
    haystack: np.ndarray,
    gap: int,
    *,
    record: int,
    digits: Sequence[int],
    depth: float | None = 0.0,
    variant: str = "access",
    digit_table: DigitTokens | None = None,
) -> NeedleTrial:
    """The needle and control sequences of one trial (see the module docstring for the layout)."""
    table = digit_table or digit_tokens(tokenizer)
    cue = list(tokenizer.encode(needle_cue(variant, record)))
    value, offsets = table.encode(digits)
    block = cue + value
    if len(haystack) < gap + len(block):
        raise EvalInputError(f"haystack has {len(haystack)} tokens; gap {gap} and its control need {gap + len(block)}")
    hay = np.asarray(haystack, dtype=np.int64)
    k = _depth_offset(depth, gap)
    eot = [tokenizer.eot_id]
    needle = np.concatenate([eot, hay[:k], block, hay[k:gap], block]).astype(np.int64)
    control = np.concatenate([eot, hay[: gap + len(block)], block]).astype(np.int64)
    value_at = len(needle) - len(value)
    targets = value_at + np.asarray(offsets, dtype=np.int64)
    return NeedleTrial(
        tokens=needle,
        control=control,
        targets=targets,
        target_ids=np.asarray([table.scored[d] for d in digits], dtype=np.int64),
        needle_at=1 + k,
        query_at=len(needle) - len(block),
        value_at=value_at,
    )


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------


def score_batch(
    model: nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    *,
    device: torch.device | None = None,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy predictions and CE at chosen positions: (B, K) long and (B, K) float, on the CPU.

    `tokens` (B, T) is what the model reads; `positions` (B, K) are positions of `tokens` whose
    next-token logits are wanted and `targets` (B, K) the tokens that should come next. Runs
    `model.trunk` over the whole input and `model.head` only on the gathered (B, K) hidden states,
    so no (T x vocab) logits exist. Eval mode, no_grad, bf16 autocast on CUDA.
    """
    with evaluating(model, autocast_dtype) as model_dev:
        dev = device or model_dev
        hidden, _ = model.trunk(tokens.to(dev))
        index = positions.to(dev).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        logits = model.head(hidden.gather(1, index)).float()
        ce = F.cross_entropy(logits.transpose(1, 2), targets.to(dev), reduction="none")
        return logits.argmax(dim=-1).cpu(), ce.float().cpu()


def _score_sequences(
    model: nn.Module,
    sequences: Sequence[np.ndarray],
    targets: Sequence[np.ndarray],
    target_ids: Sequence[np.ndarray],
    pad_id: int,
    batch_tokens: int,
    device: torch.device | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Score many full sequences (each fed minus its last token), in right-padded batches."""
    per_batch = max(1, batch_tokens // max(len(s) for s in sequences))
    preds, ces = [], []
    for start in range(0, len(sequences), per_batch):
        rows = range(start, min(start + per_batch, len(sequences)))
        inputs = pad_right([sequences[i][:-1] for i in rows], pad_id)
        positions = torch.as_tensor(np.stack([targets[i] - 1 for i in rows]))  # logits at p-1 predict p
        wanted = torch.as_tensor(np.stack([target_ids[i] for i in rows]))
        pred, ce = score_batch(model, inputs, positions, wanted, device=device)
        preds.append(pred.numpy())
        ces.append(ce.numpy())
    return np.concatenate(preds), np.concatenate(ces)


def generate_greedy(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    *,
    max_batch: int,
    prefill_chunk: int = 2048,
    use_cache: bool = True,
) -> np.ndarray:
    """Greedy free-running continuations (N, new_tokens) of `prompts`, with the generation engine.

    Never stops early (no EOT). At most `max_batch` sequences decode at once; each prompt is prefilled
    in chunks of `prefill_chunk` tokens. `use_cache=False` recomputes the full forward for every token
    (the engine's check path; it also runs models without a cache, such as the tests' hand-made ones).
    The model's train/eval mode is restored.
    """
    from atma_titan.inference import Generator, Request  # only generation needs the engine

    was_training = model.training
    try:
        engine = Generator(
            model, max_batch=max(1, min(max_batch, len(prompts))), max_context=max(map(len, prompts)) + new_tokens,
            prefill_chunk=max(1, prefill_chunk), eot_id=None, use_cache=use_cache,
        )  # fmt: skip
        requests = [Request([int(t) for t in p], new_tokens, i) for i, p in enumerate(prompts)]
        out = [[] for _ in prompts]
        for event in engine.generate(requests):
            out[event.index].append(event.token)
    finally:
        model.train(was_training)
    if any(len(row) != new_tokens for row in out):
        raise RuntimeError(f"the generation engine stopped a sequence before {new_tokens} new tokens")
    return np.asarray(out, dtype=np.int64).reshape(len(prompts), new_tokens)


def score_generated(
    generated: np.ndarray, expected: np.ndarray, offsets: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(N, K) bool: generated == expected at the K scored `offsets` of each value (N, L); (N,) bool: all L equal.

    The second counts every token of the value (the spaces between byte-tokenizer digits too).
    """
    generated, expected = np.asarray(generated), np.asarray(expected)
    if generated.shape != expected.shape:
        raise ValueError(f"generated {generated.shape} and expected {expected.shape} values differ in shape")
    offsets = np.asarray(offsets, dtype=np.int64)
    return generated[:, offsets] == expected[:, offsets], (generated == expected).all(axis=1)


def generated_scores(
    model: nn.Module,
    prompts: Sequence[np.ndarray],
    expected: Sequence[np.ndarray],
    offsets: Sequence[int],
    batch_tokens: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Generate each prompt's value (as many tokens as `expected` has) and score it (`score_generated`)."""
    value_len = len(expected[0])
    longest = max(len(p) for p in prompts) + value_len
    generated = generate_greedy(
        model, prompts, value_len, max_batch=max(1, batch_tokens // longest), prefill_chunk=batch_tokens
    )
    return score_generated(generated, np.stack(expected), offsets)


@dataclass
class NeedleResult:
    """One condition, as written to results.json (`asdict`).

    mode "teacher_forced": greedy argmax per digit with the true digits fed, CE and (optionally) the
    control's CE; mode "generated": the value written free-running, no CE (None) and no control.
    """

    variant: str
    gap: int
    depth: float
    trials: int
    digit_acc: float
    exact_acc: float
    ce: float | None
    control_ce: float | None
    mode: str = TEACHER_FORCED

    def line(self) -> str:
        head = f"needle {self.variant:<7} gap {size_label(self.gap):>5} depth {self.depth:.2f}"
        acc = f"digit acc {100 * self.digit_acc:.1f}%, exact {100 * self.exact_acc:.1f}%"  # percent, as the tables
        if self.mode == GENERATED:
            return f"{head} generated: {acc}"
        control = "" if self.control_ce is None else f", control CE {self.control_ce:.3f}"
        return f"{head} teacher-forced: {acc}, CE {self.ce:.3f}{control}"

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate_needle(
    model: nn.Module,
    tokenizer,
    haystack,
    *,
    gap: int,
    depth: float | None = 0.0,
    variant: str = "access",
    trials: int = 20,
    seed: int = 0,
    control: bool = True,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    device: torch.device | None = None,
    digit_table: DigitTokens | None = None,
    generate: bool = False,
) -> NeedleResult:
    """Run `trials` trials of one (variant, gap, depth) condition; `haystack.tokens(trial, n)` gives text.

    generate: score the value the model writes free-running (`generate_greedy`, on the model's device)
    instead of teacher-forced; `control` is then ignored (there is none).
    """
    if trials < 1:
        raise EvalInputError(f"trials must be >= 1, got {trials}")
    table = digit_table or digit_tokens(tokenizer)
    built = []
    for trial in range(trials):
        record, digits = sample_needle(seed, trial)
        hay = haystack.tokens(trial, haystack_tokens_needed(gap))
        built.append(
            build_needle(
                tokenizer, hay, gap, record=record, digits=digits, depth=depth, variant=variant, digit_table=table
            )
        )
    if generate:
        hits, exact = generated_scores(
            model, [t.tokens[: t.value_at] for t in built], [t.value for t in built], built[0].value_offsets,
            batch_tokens,
        )  # fmt: skip
        return NeedleResult(
            variant, int(gap), float(depth or 0.0), trials, float(hits.mean()), float(exact.mean()), None, None,
            mode=GENERATED,
        )  # fmt: skip
    sequences = [t.tokens for t in built] + ([t.control for t in built] if control else [])
    targets = [t.targets for t in built] * (2 if control else 1)
    target_ids = [t.target_ids for t in built] * (2 if control else 1)
    pred, ce = _score_sequences(model, sequences, targets, target_ids, tokenizer.eot_id, batch_tokens, device)
    correct = pred[:trials] == np.stack(target_ids[:trials])
    return NeedleResult(
        variant=variant,
        gap=int(gap),
        depth=float(depth or 0.0),
        trials=trials,
        digit_acc=float(correct.mean()),
        exact_acc=float(correct.all(axis=1).mean()),
        ce=float(ce[:trials].mean()),
        control_ce=float(ce[trials:].mean()) if control else None,
    )


def run_needle(
    model: nn.Module,
    tokenizer,
    haystack,
    *,
    gaps: Iterable[int],
    depths: Iterable[float] = (0.0,),
    variants: Iterable[str] = ("access",),
    trials: int = 20,
    seed: int = 0,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    device: torch.device | None = None,
    progress: Callable[[str], None] | None = print,
    generate: bool = False,
    control: bool = True,
) -> list[NeedleResult]:
    """Every (variant, depth, gap) condition, gaps innermost; one progress line per condition.

    generate: the generated mode (see `evaluate_needle`), else teacher-forced with the control (unless not
    `control`).
    """
    table = digit_tokens(tokenizer)  # fail before any model work on a tokenizer that splits digits
    results = []
    for variant in variants:
        needle_cue(variant, 0)  # reject an unknown variant up front
        for depth in depths:
            for gap in gaps:
                start = time.perf_counter()
                result = evaluate_needle(
                    model,
                    tokenizer,
                    haystack,
                    gap=gap,
                    depth=depth,
                    variant=variant,
                    trials=trials,
                    seed=seed,
                    batch_tokens=batch_tokens,
                    device=device,
                    digit_table=table,
                    generate=generate,
                    control=control,
                )
                results.append(result)
                if progress:
                    progress(f"{result.line()} ({time.perf_counter() - start:.1f} s)")
    return results


def quick_needle(
    model: nn.Module,
    tokenizer,
    gaps: Sequence[int] = (256, 512),
    trials: int = 4,
    seed: int = 0,
    device: torch.device | None = None,
) -> dict[str, float]:
    """A small needle for logging during training: {"needle_acc@256": ..., "needle_ce@256": ..., ...}.

    Access cue, filler haystack, depth 0, no control. Works on a plain or an FSDP2 model (under
    torch.distributed every rank must call it, with the same arguments: the forward is collective);
    the model's train/eval mode is restored. Raises `EvalInputError` if the tokenizer's digits are
    not single tokens.
    """
    haystack = FillerHaystack(tokenizer)
    table = digit_tokens(tokenizer)
    out = {}
    for gap in gaps:
        r = evaluate_needle(
            model,
            tokenizer,
            haystack,
            gap=gap,
            trials=trials,
            seed=seed,
            control=False,
            device=device,
            digit_table=table,
        )
        out[f"needle_acc@{gap}"] = r.digit_acc
        out[f"needle_ce@{gap}"] = r.ce
    return out
