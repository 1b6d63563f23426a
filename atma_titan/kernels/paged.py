"""A paged KV cache, as the decode kernels read it: page tensors, block tables, and plain-PyTorch paths.

    k_pages, v_pages   (num_pages, page_size, Hkv, D)   one tensor per layer, pages in any order
    block_table        (B, max_blocks) int32            block_table[b, j] = page holding positions
                                                         j * page_size ... (j + 1) * page_size - 1 of b
    context_lens       (B,) int32                       keys cached for b (its current token included)

Entries of a block table past a sequence's last page are never read; they may hold any valid page
index (the inference engine points them at a scratch page so CUDA-graph shapes stay fixed).

`write_pages` stores new keys at their positions, `gather_pages` reads a batch's pages back as a
contiguous (B, max_blocks * page_size, Hkv, D) tensor, and `softmax_decode` is the plain decode path
for the softmax ablation over that gathered view. Nothing here knows about models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gather_pages", "key_mask", "softmax_decode", "write_pages"]


def write_pages(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store k, v (B, T, Hkv, D) at token positions (B, T) of each sequence, in place.

    Index arithmetic on the device only (no host sync), so it can run inside a CUDA graph.
    """
    page_size = k_pages.shape[1]
    block = torch.div(positions, page_size, rounding_mode="floor")
    page = torch.gather(block_table.long(), 1, block).flatten()
    offset = (positions % page_size).flatten()
    k_pages[page, offset] = k.flatten(0, 1).to(k_pages.dtype)
    v_pages[page, offset] = v.flatten(0, 1).to(v_pages.dtype)


def gather_pages(pages: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(num_pages, page_size, Hkv, D) pages read through block_table (B, nb) -> (B, nb * page_size, Hkv, D)."""
    b, nb = block_table.shape
    return pages[block_table.long()].reshape(b, nb * pages.shape[1], *pages.shape[2:])


def key_mask(context_lens: torch.Tensor, width: int, window: int = 0) -> torch.Tensor:
    """(B, width) bool: position j is a key of the query at position context_lens[b] - 1 (optional window)."""
    j = torch.arange(width, device=context_lens.device)[None, :]
    n = context_lens.long()[:, None]
    visible = j < n
    if window > 0:
        visible &= j >= n - window
    return visible


def softmax_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    window: int = 0,
) -> torch.Tensor:
    """Softmax attention of one query per sequence, q (B, H, D), over its cached keys -> (B, H, D) in q's dtype.

    The plain path: the pages are gathered to a contiguous tensor and masked, so it reads every entry of
    the block table (the softmax variant is an ablation; Polar has the paged kernel).
    """
    b, h, d = q.shape
    k = gather_pages(k_pages, block_table).transpose(1, 2)  # (B, Hkv, T, D)
    v = gather_pages(v_pages, block_table).transpose(1, 2)
    group = h // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = key_mask(context_lens, k.shape[2], window)[:, None, None, :]  # (B, 1, 1, T)
    o = F.scaled_dot_product_attention(q[:, :, None, :], k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
    return o[:, :, 0, :]
