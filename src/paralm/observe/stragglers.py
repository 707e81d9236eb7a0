"""Which rank holds the others back: every rank's own time per step, and a warning for a persistent straggler.

A rank's own time is what it spends in a step before it first waits for its peers (`step_watch`); the
step's metrics collective brings the slowest and the fastest to every rank as two maxima, so finding
them costs no extra synchronisation. A rank slowest in most of the last `WINDOW` steps, each time by
more than `log.straggler_threshold_s` and `RELATIVE` of the step, is named in one warning line.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

WINDOW = 8  # steps a straggler is judged over
RELATIVE = 0.1  # a lead under this share of the step time is noise, whatever the threshold
_RESOLUTION = 1e6  # own times are encoded to the microsecond


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
            f"(by {lead:.2f} s on average before its first collective); the others wait for it"
        )
