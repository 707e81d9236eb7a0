"""A rank slowed on purpose (`sync.straggler_rank`), to measure how each synchronisation mode copes
with heterogeneous workers: all-reduce waits for the slowest, an asynchronous parameter server does not."""

from __future__ import annotations

import time

from paralm.config.schema import SyncConfig


def straggle(sync: SyncConfig, rank: int) -> None:
    """Sleep `sync.straggler_delay_s` if this is the straggler; called once per step of computation."""
    if rank == sync.straggler_rank and sync.straggler_delay_s > 0:
        time.sleep(sync.straggler_delay_s)
