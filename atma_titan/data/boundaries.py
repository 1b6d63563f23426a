"""Where documents begin inside a batch of training windows, for `data.document_mask`.

Every source puts the end-of-text id before each document (the llm.c layout: synthetic windows, .bin
shards, and the packed text and Hugging Face streams alike), and no tokenizer here yields that id from
text (tokenizer.py: special-token text is encoded as text). So a window's document boundaries are a
function of its tokens: a document begins at each EOT, and at position 0 (a window may open inside a
document). They are computed on the device per micro-batch, which keeps the loaders, their state in
checkpoints and every source unchanged, and gives the kernels their form (kernels/documents.py).
"""

from __future__ import annotations

import torch

from atma_titan.kernels.documents import doc_start_from_flags

__all__ = ["document_starts"]


def document_starts(inputs: torch.Tensor, eot_id: int) -> torch.Tensor:
    """int32 doc_start (B, T) of input windows (B, T): the position where each token's document begins."""
    return doc_start_from_flags(inputs == eot_id)
