"""Which rank holds the others back: every rank's own time per step, and a warning for a persistent straggler.

A rank's own time is the part of a step it spends working rather than waiting for its peers (`OwnTime`).
Wall time cannot tell them apart once a collective may have been entered: under FSDP, tensor, context,
expert and pipeline parallelism the forward communicates from its first layer, and a rank that waits there
for a slow peer shows that peer's delay as its own. So, like straggler detectors that score ranks by their
compute kernels' durations (NVIDIA Resiliency Extension) rather than by the step's wall time, the time after
the batch is loaded is counted as the CPU time of the rank's main thread, which a thread blocked in a
collective does not use. The step's metrics collective brings the slowest and the fastest to every rank as
two maxima, so finding them costs no extra synchronisation. A rank slowest in most of the last `WINDOW`
steps, each time by more than `log.straggler_threshold_s` and `RELATIVE` of the step, is named in one
warning line.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

WINDOW = 8  # steps a straggler is judged over
RELATIVE = 0.1  # a lead under this share of the step time is noise, whatever the threshold
_RESOLUTION = 1e6  # own times are encoded to the microsecond


class OwnTime:
    """One rank's own time in a step: wall time until its batch is loaded (data, host work and the
    `sync.straggler_*` injector's sleep; no layout communicates before), then its main thread's CPU time to the
    step's end. A collective blocks the thread without using the CPU (gloo waits on a condition variable; NCCL
    does not block the host), so a peer's delay is not counted; a rank slowed by other processes on its cores
    (waiting for a CPU, not using one) shows only before its batch is loaded."""

    def __init__(self) -> None:
        self._start = self._loading_s = self._loaded_cpu = 0.0

    def started(self) -> None:
        self._start = time.perf_counter()

    def loaded(self) -> None:
        self._loading_s = time.perf_counter() - self._start
        self._loaded_cpu = time.thread_time()

    def ended(self) -> float:
        """The step's own seconds; called on the thread that ran it."""
        return self._loading_s + time.thread_time() - self._loaded_cpu


def encode(own_s: float, rank: int, world_size: int) -> tuple[float, float]:
    """This rank's own time as two metrics maxima: (time, rank) packed so that the largest is the
    slowest rank's, and minus the time, whose maximum is minus the fastest's. Exact in float64 for
    steps up to years on a million ranks."""
    return float(round(own_s * _RESOLUTION) * world_size + rank), -own_s


def decode(slowest: float, neg_fastest: float, world_size: int) -> dict[str, Any]:
    """The metrics row's figures from the two reduced maxima (nothing for a single process)."""
    if world_size < 2:
        return {}
    ticks, rank = divmod(int(slowest), world_size)
    return {"slowest_rank": rank, "step_time_spread": max(0.0, ticks / _RESOLUTION + neg_fastest)}


def persistent_straggler(
    window: list[tuple[int, float, float]], threshold_s: float, relative: float = RELATIVE
) -> tuple[int, int, float] | None:
    """Over a full window of steps (slowest rank, spread, step time), the rank slowest by a clear
    margin in most of them: (rank, how many steps, its mean lead over those steps); None if none is."""
    if len(window) < WINDOW or threshold_s <= 0:
        return None
    clear = [(rank, spread) for rank, spread, step_s in window if spread > max(threshold_s, relative * step_s)]
    if not clear:
        return None
    rank, count = Counter(rank for rank, _ in clear).most_common(1)[0]
    if count <= len(window) // 2:
        return None
    lead = sum(spread for r, spread in clear if r == rank) / count
    return rank, count, lead


@dataclass
class StragglerWatch:
    """Rank 0's judge of the metrics rows: a warning when a straggler appears, again only when it changes."""

    threshold_s: float
    _window: deque[tuple[int, float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _named: int | None = None

    def review(self, row: dict[str, Any]) -> str | None:
        if "slowest_rank" not in row:
            return None
        self._window.append((row["slowest_rank"], row["step_time_spread"], row["step_time_s"]))
        found = persistent_straggler(list(self._window), self.threshold_s)
        if found is None or found[0] == self._named:
            return None
        rank, count, lead = found
        self._named = rank
        return (
            f"warning: rank {rank} is the slowest in {count} of the last {len(self._window)} steps "
            f"(by {lead:.2f} s on average); the others wait for it"
        )
