"""What the lm-evaluation-harness asks of a model, computed with an ATMA checkpoint (no lm_eval types here).

* `loglikelihood`: the summed log-probability of a continuation given its context, and whether
  greedy decoding would have written it; batched, right-padded (safe for a causal model, see
  atma_titan.inference.context.pad_right), the LM head applied only at the continuation's positions.
* `loglikelihood_rolling`: the log-probability of a whole text, in windows of `max_length` tokens
  (the harness's rolling windows). A text of at most `max_length` tokens is one window,
  `[EOT] + text`: exactly the sequence the eval command's length curve scores (minus its NLL sum).
* `generate_until`: text generated through atma_titan.inference.Generator (paged cache, batched),
  greedy unless a temperature is given, stopped at the first stop string or after `max_gen_toks`.

Every sequence starts with the EOT id, as every training document (and the eval and generate
commands' inputs) does; sequences longer than `max_length` keep their last tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from atma_titan.utils.errors import InputError
from atma_titan.inference.context import evaluating, pad_right
from atma_titan.inference import Generator, Request, Sampling, cast_for_inference

__all__ = ["DEFAULT_MAX_GEN_TOKS", "AtmaScorer", "GenerationSettings", "generation_settings"]

DEFAULT_MAX_GEN_TOKS = 256  # the harness's default when a task names none


@dataclass(frozen=True)
class GenerationSettings:
    """One request's generation options, from a task's `generation_kwargs`."""

    until: tuple[str, ...]
    max_gen_toks: int
    sampling: Sampling


def generation_settings(gen_kwargs: dict, default_max_gen_toks: int = DEFAULT_MAX_GEN_TOKS) -> GenerationSettings:
    """`until` (a string or a list), `max_gen_toks` (or max_new_tokens), `do_sample`, `temperature`,
    `top_k`, `top_p`: greedy unless do_sample is true or a temperature > 0 is given without do_sample."""
    kwargs = dict(gen_kwargs or {})
    until = kwargs.get("until") or []
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, (list, tuple)) or not all(isinstance(s, str) for s in until):
        raise InputError(f"generation_kwargs until = {until!r}: expected a string or a list of strings")
    max_gen_toks = kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", default_max_gen_toks))
    if not isinstance(max_gen_toks, int) or max_gen_toks < 1:
        raise InputError(f"generation_kwargs max_gen_toks = {max_gen_toks!r}: expected an integer >= 1")
    temperature = float(kwargs.get("temperature") or 0.0)
    do_sample = kwargs.get("do_sample")
    if do_sample is False:
        temperature = 0.0
    sampling = Sampling(temperature, int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0))
    return GenerationSettings(tuple(s for s in until if s), max_gen_toks, sampling)


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """`text` up to (not including) the earliest stop string it holds."""
    ends = [text.find(stop) for stop in until]
    return text[: min((e for e in ends if e >= 0), default=len(text))]


class AtmaScorer:
    """An ATMA model and its tokenizer, answering the harness's three request types (module docstring).

    batch_size: sequences per forward pass (and sequences decoded at once); max_length: the longest
    sequence fed (default for checkpoints: the run's training.seq_len); seed: the sampler's.
    """

    def __init__(self, model, tokenizer, *, max_length: int, batch_size: int = 1, seed: int = 0, progress: bool = True):
        if batch_size < 1:
            raise InputError(f"--batch-size {batch_size} is invalid; allowed: an integer >= 1")
        if max_length < 2:
            raise InputError(f"--max-length {max_length} is invalid; allowed: an integer >= 2")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eot_id = int(tokenizer.eot_id)
        self.max_length = int(max_length)
        self.batch_size = int(batch_size)
        self.seed = seed  # of the sampler, for generation with a temperature
        self.progress = progress
        self.device = next(model.parameters()).device
        self.checkpoint = None  # the ResolvedCheckpoint it was loaded from, if any

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        step: int | None = None,
        config: str | Path | None = None,
        device: str = "auto",
        batch_size: int = 1,
        max_length: int | None = None,
        seed: int = 0,
        progress: bool = True,
    ) -> "AtmaScorer":
        """Any checkpoint the eval command takes (atma_titan.checkpoint.open), on one device."""
        from atma_titan.checkpoint.open import open_checkpoint

        opened = open_checkpoint(path, step, config)  # bad paths and steps raise before a model is built
        return cls.from_opened(
            opened, device=device, batch_size=batch_size, max_length=max_length, seed=seed, progress=progress
        )

    @classmethod
    def from_opened(
        cls,
        opened,
        *,
        device: str = "auto",
        batch_size: int = 1,
        max_length: int | None = None,
        seed: int = 0,
        progress: bool = True,
    ) -> "AtmaScorer":
        """Load the weights of an `atma_titan.checkpoint.open.OpenCheckpoint` onto `device`."""
        from atma_titan.utils.device import resolve_device
        from atma_titan.checkpoint.open import load_eval_model

        dev = resolve_device(device or "auto", what="--device")
        model = load_eval_model(opened.model_args, opened.resolved, dev)
        if dev.type == "cuda":  # bf16 Linear weights: what autocast computes with anyway (as the generate command)
            cast_for_inference(model, torch.bfloat16)
        scorer = cls(
            model,
            opened.tokenizer,
            max_length=max_length or opened.cfg.training.seq_len,
            batch_size=batch_size,
            seed=seed,
            progress=progress,
        )
        scorer.checkpoint = opened.resolved
        return scorer

    # -- tokens -----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """([EOT] + context tokens, continuation tokens); trailing spaces of the context go to the
        continuation and the pair is encoded whole, so a word and its leading space stay one token."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode(context + continuation)
        context_tokens = self.encode(context) if context else []
        return [self.eot_id] + context_tokens, whole[len(context_tokens) :]

    def _bar(self, total: int, what: str):
        return tqdm(total=total, desc=f"Running {what} requests", disable=not self.progress)

    # -- scoring ----------------------------------------------------------------------------------

    def score_tokens(self, pairs: Sequence[tuple[list[int], list[int]]], what: str = "loglikelihood"):
        """[(summed log-prob of continuation, is_greedy)] for (context, continuation) token pairs.

        Each pair is fed as context + continuation[:-1], its last max_length tokens; longest first, so
        a batch pads little."""
        inputs, widths = [], []
        for number, (context, continuation) in enumerate(pairs):
            if not context or not continuation:
                raise InputError(f"request {number}: the context and the continuation need a token each")
            if len(continuation) > self.max_length:
                raise InputError(
                    f"request {number}: a continuation of {len(continuation)} tokens is longer than max_length "
                    f"{self.max_length}"
                )
            inputs.append(np.asarray((context + continuation)[-(self.max_length + 1) : -1], dtype=np.int64))
            widths.append(len(continuation))
        order = sorted(range(len(pairs)), key=lambda i: -len(inputs[i]))
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        with self._bar(len(pairs), what) as bar, evaluating(self.model) as device:
            for start in range(0, len(order), self.batch_size):
                rows = order[start : start + self.batch_size]
                hidden, _ = self.model.trunk(pad_right([inputs[i] for i in rows], self.eot_id).to(device))
                for row, i in enumerate(rows):
                    end = len(inputs[i])
                    logits = self.model.head(hidden[row, end - widths[i] : end]).float()
                    target = torch.as_tensor(pairs[i][1], device=logits.device)
                    logp = F.log_softmax(logits, dim=-1).gather(-1, target[:, None])[:, 0]
                    results[i] = (float(logp.double().sum()), bool((logits.argmax(-1) == target).all()))
                bar.update(len(rows))
        return results

    def loglikelihood(self, requests: Iterable[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log p(continuation | [EOT] + context), is_greedy) for (context, continuation) strings."""
        pairs = []
        for number, (context, continuation) in enumerate(requests):
            pair = self.encode_pair(context, continuation)
            if not pair[1]:
                raise InputError(f"request {number}: continuation {continuation!r} encodes to no tokens")
            pairs.append(pair)
        return self.score_tokens(pairs)

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """The harness's disjoint rolling windows of `tokens`: every token predicted once, the first
        after EOT, each window of at most max_length inputs."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows = get_rolling_token_windows(tokens, self.eot_id, self.max_length, context_len=1)
        return [make_disjoint_window(w) for w in windows]

    def loglikelihood_rolling(self, texts: Iterable[str]) -> list[float]:
        """log p(text | EOT) of each whole text (a text of <= max_length tokens: one window)."""
        texts = list(texts)
        windows, owner = [], []
        for number, text in enumerate(texts):
            for window in self.rolling_windows(self.encode(text)):
                windows.append(window)
                owner.append(number)
        totals = [0.0] * len(texts)  # an empty text has no window and log-probability 0
        for number, (logp, _) in zip(owner, self.score_tokens(windows, "loglikelihood_rolling")):
            totals[number] += logp
        return totals

    # -- generation -------------------------------------------------------------------------------

    def _stop_at(self, until: Sequence[str]):
        """Request.stop for `until`: whether the text generated so far holds one of the stop strings."""
        if not until:
            return None
        return lambda generated: any(stop in self.tokenizer.decode(generated) for stop in until)

    def generate_until(self, requests: Sequence[tuple[str, dict]]) -> list[str]:
        """The text generated after [EOT] + context, up to its first stop string, for (context, gen_kwargs)."""
        settings = [generation_settings(kwargs) for _, kwargs in requests]
        groups: dict[tuple, list[int]] = {}  # one Generator per sampling and length
        for i, s in enumerate(settings):
            groups.setdefault((s.sampling, s.max_gen_toks), []).append(i)
        out: list[str] = [""] * len(requests)
        with self._bar(len(requests), "generate_until") as bar:
            for (sampling, max_gen_toks), members in groups.items():
                if max_gen_toks >= self.max_length:
                    raise InputError(
                        f"max_gen_toks {max_gen_toks} leaves no room for a prompt in max_length {self.max_length}"
                    )
                keep = self.max_length - max_gen_toks  # the prompt's last tokens, as the harness's HF model does
                prompts = {i: ([self.eot_id] + self.encode(requests[i][0]))[-keep:] for i in members}
                engine = Generator(
                    self.model,
                    max_batch=min(self.batch_size, len(members)),
                    max_context=max(len(p) for p in prompts.values()) + max_gen_toks,
                    eot_id=self.eot_id,
                    sampling=sampling,
                    seed=self.seed,
                )
                generated: dict[int, list[int]] = {i: [] for i in members}
                # a sequence finishes after the token that completes a stop string: its slot and pages go to
                # the next prompt at once, instead of decoding up to max_gen_toks tokens that are cut off
                batch = [Request(prompts[i], max_gen_toks, i, self._stop_at(settings[i].until)) for i in members]
                for event in engine.generate(batch):
                    if event.finished != "eot":
                        generated[event.index].append(event.token)
                    if event.finished:
                        text = self.tokenizer.decode(generated.pop(event.index))
                        out[event.index] = cut_at_stop(text, settings[event.index].until)
                        bar.update(1)
        return out
