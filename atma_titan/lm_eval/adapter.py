"""The lm-evaluation-harness model "atma_titan": an `lm_eval.api.model.LM` over `AtmaScorer`.

    from atma_titan.lm_eval import register
    register()  # now lm_eval.simple_evaluate(model="atma_titan", model_args={"checkpoint": PATH}, ...)

The class is built (and registered) on first use, so importing atma_titan needs no lm_eval: the
harness is an optional extra (`pip install 'atma_titan[lm_eval]'`).
"""

from __future__ import annotations

import functools

from atma_titan.utils.errors import InputError, import_optional

__all__ = ["MODEL_NAME", "adapter_class", "register"]

MODEL_NAME = "atma_titan"


def _batch_size(value) -> int:
    """The harness passes --batch_size through as given: an int, or a string such as "8" or "auto"."""
    try:
        size = int(value) if value is not None else 1
    except (TypeError, ValueError):
        raise InputError(f"batch_size {value!r} is invalid; allowed: an integer >= 1 (no 'auto')") from None
    if size < 1:
        raise InputError(f"batch_size {value!r} is invalid; allowed: an integer >= 1")
    return size


def _optional_int(value, what: str) -> int | None:
    if value in (None, ""):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"{what} {value!r} is invalid; allowed: an integer") from None


@functools.cache
def adapter_class() -> type:
    """The `lm_eval.api.model.LM` subclass (made once, when lm_eval imports)."""
    model_module = import_optional("lm_eval.api.model", "lm_eval", "the lm-eval adapter", package="lm-eval")

    class AtmaTitanLM(model_module.LM):
        """model_args: checkpoint=PATH (any checkpoint the eval command takes), step, config, max_length;
        batch_size and device come from the harness's --batch_size and --device."""

        def __init__(
            self,
            checkpoint: str | None = None,
            step=None,
            config: str | None = None,
            max_length=None,
            device: str | None = None,
            batch_size=1,
            max_batch_size=None,  # the harness passes it; there is no automatic batch size here
            scorer=None,
            **unknown,
        ):
            super().__init__()
            if unknown:
                raise InputError(
                    f"model_args {', '.join(sorted(unknown))} not understood; allowed: checkpoint, step, config, "
                    "max_length"
                )
            if scorer is None:
                if not checkpoint:
                    raise InputError("the atma_titan model needs model_args checkpoint=PATH")
                from atma_titan.utils.known_warnings import silence_known_warnings
                from atma_titan.lm_eval.scorer import AtmaScorer

                silence_known_warnings()  # DCP's warning about loading without torch.distributed
                scorer = AtmaScorer.from_checkpoint(
                    checkpoint,
                    step=_optional_int(step, "step"),
                    config=config,
                    device=device or "auto",
                    batch_size=_batch_size(batch_size),
                    max_length=_optional_int(max_length, "max_length"),
                )
            self.scorer = scorer
            self._device = scorer.device

        @property
        def tokenizer_name(self) -> str:
            return self.scorer.tokenizer.name

        @property
        def max_length(self) -> int:
            return self.scorer.max_length

        @property
        def batch_size(self) -> int:
            return self.scorer.batch_size

        def get_model_info(self) -> dict:
            """Added to results["config"] by simple_evaluate."""
            resolved = getattr(self.scorer, "checkpoint", None)
            info = {"tokenizer": self.scorer.tokenizer.name, "max_length": self.scorer.max_length}
            if resolved is not None:
                info.update(checkpoint=str(resolved.path), step=resolved.step)
            return info

        def _answer(self, kind: str, requests, results):
            for request, result in zip(requests, results):
                self.cache_hook.add_partial(kind, request.args, result)
            return results

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self._answer("loglikelihood", requests, self.scorer.loglikelihood([r.args for r in requests]))

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            texts = [r.args[0] for r in requests]
            return self._answer("loglikelihood_rolling", requests, self.scorer.loglikelihood_rolling(texts))

        def generate_until(self, requests, disable_tqdm: bool = False):
            return self._answer("generate_until", requests, self.scorer.generate_until([r.args for r in requests]))

    return AtmaTitanLM


@functools.cache
def register() -> type:
    """Register the adapter with the harness as "atma_titan" (once); returns its class."""
    registry = import_optional("lm_eval.api.registry", "lm_eval", "the lm-eval adapter", package="lm-eval")
    # the harness fills its registry with its own models only while the registry is empty: do that first,
    # or "hf" and the others would be unknown in this process after ours is registered
    import_optional("lm_eval.models", "lm_eval", "the lm-eval adapter", package="lm-eval")
    cls = adapter_class()
    registry.register_model(MODEL_NAME)(cls)
    return cls
