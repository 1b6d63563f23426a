"""Evaluation (docs/model.md section 7): the induction needle (teacher-forced, or generated free-running
with `--generate`) and the length curve.

    python -m atma_titan.eval --checkpoint <run>/ --gaps 2K,4K,...,64K --length-curve

* `needle`: build needle/control sequences, score the 5 value digits (`score_batch` runs the trunk
  once and the LM head only at the scored positions), `run_needle` over gaps x depths x variants,
  and `quick_needle` for logging during training;
* `records`: the same probe in the built-in synthetic language;
* `length`: mean NLL per token on nested prefixes of the same long documents, one forward pass
  per document at the longest length, the head applied in chunks;
* `corpus`: the passkey filler and long documents from the run's data (text, HF, .bin, synthetic);
* `report`: results.json / results.md (percent tables) and the plots (torch-free);
* `compare`: several results.json side by side, one table and one figure (`python -m
  atma_titan.compare`; torch-free);
* `plots`: the needle and length-curve figures, one model or a sweep's many (torch-free);
* `common`: the bad-input error and size parsing (torch-free);
* `validation`: the validation loss and quick needle the trainer logs every `eval.interval` steps.

A checkpoint is opened by atma_titan.checkpoint.open; the eval-mode context is atma_titan.inference.context.

The names below import lazily, on first use: `import atma_titan.eval.report` loads no torch.
"""

from __future__ import annotations

from atma_titan.utils.lazy_exports import lazy_exports

_EXPORTS = {
    "common": ["EvalInputError", "parse_sizes", "size_label"],
    "corpus": ["FILLER", "DocumentHaystack", "FillerHaystack", "LongDocuments", "corpus_from_config"],
    "length": ["LengthCurve", "length_curve", "length_sequences", "nested_prefix_nll", "token_losses"],
    "needle": [
        "DigitTokens",
        "NeedleResult",
        "NeedleTrial",
        "build_needle",
        "digit_tokens",
        "evaluate_needle",
        "quick_needle",
        "run_needle",
        "sample_needle",
        "score_batch",
    ],
    "plots": ["needle_figure", "needle_panels", "length_figure", "length_series"],
    "report": ["plot_length_curves", "plot_needle", "write_results"],
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
