"""State a DDP communication hook keeps per bucket (flat tensors), held by parameter name in between.

DDP fills its buckets in parameter order on the first step and in gradient-ready order from then on,
so a run resumed from a checkpoint sees another bucket layout on its first step than the uninterrupted
run did at the same step. Hook state saved per bucket would then be added to the wrong entries. Here
every flat table (top-k residuals, PowerSGD's error feedback and warm-start Q) is cut into named
per-parameter pieces whenever a bucket's layout changes or a checkpoint is taken, and put back
together in the layout the hook sees next: resuming is exact whatever the layouts.

A step may be skipped after its hooks ran (a NaN/inf gradient, an fp16 overflow): each hook `stash`es
its bucket's entries before changing them and `settle` keeps the new ones or puts those back. Entries
the hook replaces are kept by reference (no copy); those it changes in place are copied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Slot = tuple[str, int, int]  # parameter name, offset in the flat table, length
BucketLayout = tuple[list[Slot], int]  # the slots, and the flat table's length
LayoutOf = Callable[[dist.GradBucket], BucketLayout]


class BucketState:
    """Flat per-bucket tables (`tables[name][bucket index]`) and where each parameter lies in them."""

    def __init__(
        self, tables: dict[str, tuple[dict[int, torch.Tensor], LayoutOf]], in_place: tuple[str, ...] = ()
    ) -> None:
        self.tables = {table: entries for table, (entries, _) in tables.items()}  # the hook's own dicts
        self.layouts = {table: layout_of for table, (_, layout_of) in tables.items()}
        self.slots: dict[str, dict[int, BucketLayout]] = {table: {} for table in tables}
        self.pieces: dict[str, dict[str, torch.Tensor]] = {table: {} for table in tables}  # not in a bucket now
        self.in_place = in_place  # tables whose entries the hook changes in place (PowerSGD's Q)
        self.stashed: dict[int, dict[str, torch.Tensor | None]] = {}  # bucket -> its entries before this step

    def stash(self, index: int) -> None:
        """Keep bucket `index`'s entries as they are before this step's hook changes them (after `align`,
        so in the layout the hook uses); a second pass before `settle` keeps the first one's."""
        if index in self.stashed:
            return
        before = {table: entries.get(index) for table, entries in self.tables.items()}
        self.stashed[index] = {t: e.clone() if t in self.in_place and e is not None else e for t, e in before.items()}

    def settle(self, skipped: torch.Tensor | bool) -> None:
        """Keep what the hooks wrote since `stash`, or where `skipped` put back what was there. A device
        flag is applied by `torch.where` (an entry that did not exist comes back as zeros, which the hooks
        read as none); a host bool restores the entries themselves."""
        for index, before in self.stashed.items():
            for table, old in before.items():
                entries = self.tables[table]
                if isinstance(skipped, bool):
                    if skipped and old is None:
                        entries.pop(index, None)
                    elif skipped:
                        entries[index] = old
                elif index in entries:
                    entries[index] = torch.where(skipped, 0.0 if old is None else old, entries[index])
        self.stashed.clear()

    def scale_(self, ratio: float, table: str) -> None:
        """Multiply `table` by `ratio` wherever its entries are (fp16's loss scale changed by it)."""
        for entries in (self.tables[table], self.pieces[table]):
            for key, flat in entries.items():
                entries[key] = flat * ratio

    def align(self, bucket: dist.GradBucket) -> None:
        """Make every table's entry for `bucket` follow its current layout (called first in the hook)."""
        index = bucket.index()
        for table, layout_of in self.layouts.items():
            layout = layout_of(bucket)
            if self.slots[table].get(index) == layout:
                continue
            old = self.tables[table].pop(index, None)
            if old is not None:
                self.pieces[table] |= _split(old, self.slots[table][index][0])
            self.slots[table][index] = layout
            if any(name in self.pieces[table] for name, _, _ in layout[0]):
                self.tables[table][index] = self._join(table, layout, bucket.buffer())

    def _join(self, table: str, layout: BucketLayout, like: torch.Tensor) -> torch.Tensor:
        slots, length = layout
        flat = torch.zeros(length, dtype=like.dtype, device=like.device)
        for name, offset, length in slots:
            piece = self.pieces[table].pop(name, None)
            if piece is not None:
                flat[offset : offset + length] = piece
        return flat

    def by_parameter(self) -> dict[str, torch.Tensor]:
        """Every table cut into `table.name` pieces: what a checkpoint holds."""
        state = {}
        for table, entries in self.tables.items():
            pieces = dict(self.pieces[table])
            for index, flat in entries.items():
                pieces |= _split(flat, self.slots[table][index][0])
            state |= {f"{table}.{name}": piece for name, piece in pieces.items()}
        return state

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Pieces from a checkpoint; each goes into a table when the hook next sees its bucket."""
        for table in self.tables:
            self.tables[table].clear()
            self.slots[table].clear()
            prefix = table + "."
            self.pieces[table] = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def buffer_layout(names: dict[int, str]) -> LayoutOf:
    """Where each parameter's gradient lies in a bucket's flat buffer (`names`: data pointer -> name)."""

    def layout(bucket: dist.GradBucket) -> BucketLayout:
        buffer = bucket.buffer()
        base = buffer.storage_offset()
        slots = [
            (names[p.data_ptr()], g.storage_offset() - base, g.numel())
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
        ]
        return slots, buffer.numel()

    return layout


def _split(flat: torch.Tensor, slots: list[Slot]) -> dict[str, torch.Tensor]:
    return {name: flat[offset : offset + length].clone() for name, offset, length in slots}
