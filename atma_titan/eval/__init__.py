"""Evaluation (ATMA.md section 7): the teacher-forced induction needle and the length curve.

    python -m atma_titan.eval --checkpoint <run>/ --gaps 2K,4K,...,64K --length-curve

* `needle`: build needle/control sequences, score the 5 value digits (`score_batch` runs the trunk
  once and the LM head only at the scored positions), `run_needle` over gaps x depths x variants,
  and `quick_needle` for logging during training;
* `length`: mean NLL per token on nested prefixes of the same long documents, one forward pass
  per document at the longest length, the head applied in chunks;
* `corpus`: the passkey filler and long documents from the run's data (text, HF, .bin, synthetic);
* `loading`: checkpoint path -> weights + run config -> model on one device;
* `report`: results.json / results.md / plots, and multi-model plots for sweeps.
"""

from atma_titan.eval.common import EvalInputError
from atma_titan.eval.corpus import FILLER, DocumentHaystack, FillerHaystack, LongDocuments, corpus_from_config
from atma_titan.eval.length import LengthCurve, length_curve, length_sequences, nested_prefix_nll, token_losses
from atma_titan.eval.loading import load_eval_model, load_run_config, resolve_checkpoint
from atma_titan.eval.needle import (
    DigitTokens,
    NeedleResult,
    NeedleTrial,
    build_needle,
    digit_tokens,
    evaluate_needle,
    quick_needle,
    run_needle,
    sample_needle,
    score_batch,
)
from atma_titan.eval.report import plot_length_curves, plot_needle, write_results

__all__ = [
    "FILLER",
    "DigitTokens",
    "DocumentHaystack",
    "EvalInputError",
    "FillerHaystack",
    "LengthCurve",
    "LongDocuments",
    "NeedleResult",
    "NeedleTrial",
    "build_needle",
    "corpus_from_config",
    "digit_tokens",
    "evaluate_needle",
    "length_curve",
    "length_sequences",
    "load_eval_model",
    "load_run_config",
    "nested_prefix_nll",
    "plot_length_curves",
    "plot_needle",
    "quick_needle",
    "resolve_checkpoint",
    "run_needle",
    "sample_needle",
    "score_batch",
    "token_losses",
    "write_results",
]
