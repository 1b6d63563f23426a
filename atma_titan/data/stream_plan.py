"""The global document cursor of a streamed source: which documents each part reads, and which are consumed.

A streamed source (``documents.TextFiles``, ``documents.HFDataset``) is a list of *files* (a
dataset's shards for HF), each a sequence of documents numbered 0, 1, 2, ... (empty ones
included, so the numbers do not depend on them). A ``StreamPlan`` is a list of *units*; a unit
is the documents ``d`` of one file with ``d % modulus == residue``, together with its cursor
``(epoch, doc)``: every document of the unit in the passes before ``epoch``, and those numbered
below ``doc`` in pass ``epoch``, are consumed. A fresh plan has one unit per file (modulus 1)
at cursor (0, 0).

Split into P parts (data-parallel ranks x loader workers): unit ``i`` belongs to part
``i mod P``. With at least as many units as parts a part therefore reads whole files
(``p, p+P, ...``). With fewer units V than parts, every unit is first *refined* into
``k = P / gcd(V, P)`` units (modulus ``M*k``, residues ``r, r+M, ..., r+(k-1)M``), each keeping its
parent's cursor, so every part gets ``lcm(V, P) / P`` units, each every k-th document of a file.
Which part gets which residue is rotated from unit to unit, so that short files leave no part
without documents as long as there are about P documents in all. Refining lasts for the rest
of the run, and a unit of modulus M reads its whole file for 1/M of its documents: a pass reads
as much as (number of units) files, at most the least common multiple of the file count and
every part count used so far (part counts with large co-prime factors, 7 then 11, multiply it).

A part reads its units in passes (``documents.SplitSource.documents``): in pass ``e`` it reads,
unit after unit, the documents of each unit from its cursor on (from 0 when the cursor is in an
earlier pass; a unit whose cursor is already past pass ``e`` is left out of pass ``e``). Its
position is ``{"epoch", "unit", "doc"}``: it is in pass ``epoch`` and the documents of unit
``unit`` numbered below ``doc`` are behind it.

Why the cursor is exact: every unit belongs to exactly one part of a split and is read in
document order, so at any moment the consumed documents of a unit are a prefix of it, which
is its cursor. ``advanced`` turns the parts' positions into the units' cursors; a resume with
another number of parts refines and re-deals the units, each continuing from its own cursor:
nothing behind a cursor is read again (in that pass), nothing ahead of it is left out, and
refining keeps "consumed = a prefix of each unit" true for the next change of split.

What counts as consumed is the packer's business (``packing.PackedBatches``): a document whose
leading EOT was an input token of a window the loader handed out. The plan is saved as JSON in
the global checkpoint state (``data.StreamCursor``), the same at every rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

__all__ = ["StreamPlan", "Unit", "Position", "PlanMismatch"]

Position = dict  # {"epoch": int, "unit": int, "doc": int}, or None: nothing of this plan consumed yet


class PlanMismatch(ValueError):
    """A saved plan that does not describe this source (another number or list of files)."""


class Unit(NamedTuple):
    file: int
    modulus: int
    residue: int
    epoch: int  # cursor: all of the passes before `epoch` consumed,
    doc: int  # and, in pass `epoch`, the documents numbered below `doc`

    @property
    def cursor(self) -> tuple[int, int]:
        return self.epoch, self.doc

    def holds(self, doc: int) -> bool:
        return doc % self.modulus == self.residue

    def first_in_pass(self, epoch: int) -> int | None:
        """The first document number to read in pass `epoch`, or None when the unit is consumed past it."""
        if self.epoch > epoch:
            return None
        return self.doc if self.epoch == epoch else 0


@dataclass(frozen=True)
class StreamPlan:
    units: tuple[Unit, ...]
    files: int  # files (or shards) of the source the plan was made for
    fingerprint: str  # of their names: a changed file list is caught at a resume
    saved_parts: int = 0  # the split whose positions were folded in last (0: none, a fresh plan)

    @classmethod
    def fresh(cls, files: int, fingerprint: str = "") -> StreamPlan:
        if files < 1:
            raise ValueError(f"a stream plan needs at least one file, got {files}")
        return cls(tuple(Unit(f, 1, 0, 0, 0) for f in range(files)), files, fingerprint)

    # ------------------------------------------------------------------ the split

    def split(self, num_parts: int) -> StreamPlan:
        """This plan with at least `num_parts` units, refined evenly when it has fewer (see the module docstring)."""
        if num_parts < 1:
            raise ValueError(f"num_parts must be >= 1, got {num_parts}")
        count = len(self.units)
        if count >= num_parts:
            return self
        k = num_parts // math.gcd(count, num_parts)
        units = []
        for q, u in enumerate(self.units):
            # Children go to k consecutive parts; rotating which residue each gets, evenly over the units, gives
            # every part an early document of some file, so short files still leave no part empty.
            shift = q * k // count
            units += [Unit(u.file, u.modulus * k, u.residue + (j + shift) % k * u.modulus, *u.cursor) for j in range(k)]
        return replace(self, units=tuple(units))

    def units_of(self, part: int, num_parts: int) -> range:
        """Indices of the units of `part` (of a plan already split for `num_parts`)."""
        if len(self.units) < num_parts:
            raise ValueError(f"a plan of {len(self.units)} units is not split for {num_parts} parts; call split()")
        return range(part, len(self.units), num_parts)

    def first_epoch(self, part: int, num_parts: int) -> int:
        """The pass a part starts in: that of its least advanced unit."""
        return min(self.units[u].epoch for u in self.units_of(part, num_parts))

    # ------------------------------------------------------------------ folding in the parts' positions

    def advanced(self, positions: dict[int, Position | None], num_parts: int) -> StreamPlan:
        """The cursors once each part has consumed up to its position (parts missing or None: nothing more)."""
        plan = self.split(num_parts)
        units = list(plan.units)
        for part, position in positions.items():
            if position is None:
                continue
            epoch, at, doc = position["epoch"], position["unit"], position["doc"]
            if at % num_parts != part:
                raise ValueError(f"position {position} is not one of part {part} of {num_parts}")
            for u in plan.units_of(part, num_parts):
                # Behind the position in this pass: read to its end; at it: up to `doc`; ahead: the pass before.
                reached = (epoch + 1, 0) if u < at else (epoch, doc) if u == at else (epoch, 0)
                unit = units[u]
                if reached > unit.cursor:
                    units[u] = unit._replace(epoch=reached[0], doc=reached[1])
        return replace(plan, units=tuple(units), saved_parts=num_parts)

    # ------------------------------------------------------------------ checks and storage

    def check_source(self, files: int, fingerprint: str, what: str) -> None:
        """Refuse a plan made for other files than the source's (`what` names the source)."""
        if files != self.files or fingerprint != self.fingerprint:
            detail = f"{self.files} files" if files != self.files else "the same number of files under other names"
            raise PlanMismatch(
                f"the checkpoint's document cursor was saved for {detail}, but {what} now has {files} files"
            )

    def to_json(self) -> str:
        return json.dumps(
            {
                "units": [list(u) for u in self.units],
                "files": self.files,
                "fingerprint": self.fingerprint,
                "saved_parts": self.saved_parts,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> StreamPlan:
        data = json.loads(text)
        return cls(
            tuple(Unit(*map(int, u)) for u in data["units"]),
            int(data["files"]),
            str(data["fingerprint"]),
            int(data["saved_parts"]),
        )

    def describe(self) -> str:
        """Where the stream stands, for the trainer's resume line: e.g. '12 units of 12 files, in pass 0'."""
        low, high = min(u.epoch for u in self.units), max(u.epoch for u in self.units)
        passes = f"pass {low}" if low == high else f"passes {low}..{high}"
        return f"{len(self.units)} units of {self.files} files, in {passes}"
