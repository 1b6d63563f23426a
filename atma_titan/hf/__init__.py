"""Hugging Face format out and in: an exported folder that `transformers` loads, and loading it back.

- configuration.py: `AtmaConfig` (model_type "atma"), every ModelArgs field as a config.json key.
- modeling.py: `AtmaForCausalLM` (PreTrainedModel + GenerationMixin) around the one ATMA model, and
  `AtmaCache`, the generation cache (KV pages, conv and memory states) that `generate()` carries.
- export.py: write the folder (weights, config, generation config, tokenizer, model card, code shims).
- load.py: read such a folder back (model args, full weights) for training and evaluation; no transformers needed.

configuration.py and modeling.py make their transformers subclasses on first use (`from
atma_titan.hf.modeling import AtmaForCausalLM`), so every module here imports without the `hf` extra.
"""
