"""lm-evaluation-harness integration: an ATMA checkpoint as the harness's model "atma_titan".

    python -m atma_titan.lm_eval --checkpoint <run>/ --tasks lambada_openai,hellaswag --limit 100

* `scorer`: `AtmaScorer`, the three request types (loglikelihood, loglikelihood_rolling,
  generate_until) computed with the model (torch only; no lm_eval types);
* `adapter`: the `lm_eval.api.model.LM` subclass over it, registered as "atma_titan" by `register()`;
* `__main__`: the command around `lm_eval.simple_evaluate`.

The harness is the optional extra `lm_eval` (pip install 'atma_titan[lm_eval]'); it is imported only
when an adapter is made or the command runs, so these modules import without it.
"""

from __future__ import annotations

from atma_titan.utils.lazy_exports import lazy_exports

_EXPORTS = {
    "adapter": ["MODEL_NAME", "adapter_class", "register"],
    "scorer": ["AtmaScorer", "GenerationSettings", "generation_settings"],
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
