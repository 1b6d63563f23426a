"""A tiny byte-level BPE tokenizer trained on the spot (tests/data/test_tokenizers.py, tests/interop/test_hf.py)."""

from __future__ import annotations

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "", "héllo wörld 日本語 🚀"]


def train_bpe(path, special_tokens, vocab_size=300):
    """A tiny byte-level BPE trained here and saved as a tokenizer.json."""
    from tokenizers import Tokenizer as HFRaw
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = HFRaw(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(TEXTS * 20, trainer)
    raw.save(str(path))
    return path
