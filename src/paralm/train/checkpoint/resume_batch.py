"""A run resumed on another layout keeps its checkpoint's global batch (the optimisation it was doing).

The data position (`samples_seen`) moves to any layout; the global batch would change silently with
the number of data-parallel ranks. Accumulation makes up the difference where it divides; only an
explicit `train.global_batch_size`, or a batch that cannot be kept, changes it, said in one line.
"""

from __future__ import annotations

from paralm.data.sampler import BatchLayout


def keep_global_batch(layout: BatchLayout, saved: object, explicit: int) -> tuple[BatchLayout, str | None]:
    """The layout to continue with, and a line to tell the user (None when nothing changed)."""
    if not isinstance(saved, int) or saved == layout.global_batch:
        return layout, None
    per_micro_step = layout.dp_size * layout.micro_batch_size
    if explicit:
        why = "train.global_batch_size"
    elif saved % per_micro_step:
        why = f"it is not a multiple of dp x train.micro_batch_size = {per_micro_step}"
    else:
        accum = saved // per_micro_step
        kept = BatchLayout(layout.dp_size, accum, layout.micro_batch_size)
        return kept, f"grad accumulation {accum} keeps the checkpoint's global batch of {saved} sequences"
    return layout, f"the global batch changes from the checkpoint's {saved} to {layout.global_batch} ({why})"
