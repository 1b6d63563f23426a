"""What every evaluation shares and needs no torch for: the bad-input error and size parsing.

Torch-free, so the sweep's collector and the report plots import it without loading torch.
"""

from __future__ import annotations

from atma_titan.utils.errors import InputError

__all__ = ["EvalInputError", "parse_sizes", "size_label"]


class EvalInputError(InputError):
    """Bad evaluation input: a gap too long, digits that are not single tokens, no document long enough, ..."""


def parse_sizes(text: str, what: str = "sizes") -> list[int]:
    """'2048,4096' or '2K,4K,64K' (K = 1024) -> [2048, 4096, ...]; raises EvalInputError on junk."""
    sizes = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        scale = 1024 if part[-1] in "kK" else 1
        number = part[:-1] if scale > 1 else part
        if not number.isdigit() or int(number) <= 0:
            raise EvalInputError(f"{what}: {part!r} is not a positive integer (like 2048 or 2K) in {text!r}")
        sizes.append(int(number) * scale)
    if not sizes:
        raise EvalInputError(f"{what}: no values in {text!r}")
    return sizes


def size_label(n: int) -> str:
    """2048 -> '2K', 65536 -> '64K', 100 -> '100'."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
