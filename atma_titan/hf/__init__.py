"""Hugging Face format out and in: an exported folder that `transformers` loads, and loading it back.

- configuration.py: `AtmaConfig` (model_type "atma"), every ModelArgs field as a config.json key.
- modeling.py: `AtmaForCausalLM` (PreTrainedModel + GenerationMixin) around the one ATMA model, and
  `AtmaCache`, the generation cache (KV pages, conv and memory states) that `generate()` carries.
- export.py: write the folder (weights, config, generation config, tokenizer, model card, code shims).
- load.py: read such a folder back (model args, full weights) for training and evaluation; no transformers needed.
- card.py: the exported folder's README.md (the model card).
- tokenizer.py: the run's tokenizer (byte, gpt2 through tiktoken, or a Hugging Face one) as the folder's
  tokenizer.json, tokenizer_config.json and special_tokens_map.json, which AutoTokenizer loads.

configuration.py and modeling.py subclass transformers' classes, so they import transformers (the `hf`
extra): without it, importing them is a one-line error naming the extra. export.py imports them inside
`export_hf`, so the rest of the package, and every other module here, imports without the extra.
"""
