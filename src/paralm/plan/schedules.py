"""Pipeline schedules as the cost model sees them: how many model chunks per rank to try, how many
micro-batches' activations a rank keeps in flight, and how long the pipeline bubble lasts. Which
combinations run is for `paralm.config.rules` to say.

Times are per micro-batch and per pipeline rank (all of that rank's layers): F forward, B full
backward (input and weight gradients, plus any recompute), W the weight-gradient part of B, which
zero-bubble schedules move into the bubble. Formulas assume m >= p micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    name: str
    chunks: tuple[int, ...]  # model chunks per rank the search tries (1: one stage per rank)
    v_shape: bool = False  # chunk i and 2p-1-i on one rank: the first rank also holds the LM head
    holds_all: bool = False  # runs every forward before any backward (GPipe, breadth-first)

    def in_flight(self, p: int, m: int, v: int, rank: int) -> float:
        """Micro-batches of this rank's activations alive at its peak (in whole-rank units)."""
        if self.holds_all:
            return m
        if self.name == "1f1b":
            # Narayanan et al. 2021 (PipeDream-Flush / Megatron 1F1B): rank r warms up with p - r forwards.
            return min(p - rank, m)
        if self.name in ("interleaved_1f1b", "interleaved_zero_bubble"):
            # Megatron-LM interleaved warm-up: (v-1)p + 2(p-r-1) chunk forwards before the first backward,
            # so rank 0 keeps p + (p-1)/v rank-units (Korthikanti et al. 2022, sec. 4.2.3).
            return min(((v - 1) * p + 2 * (p - rank - 1) + 1) / v, m)
        if self.name == "zbv_zero_bubble":
            # Qi et al. 2024 (Pipeline Parallelism with Controllable Memory): ZB-V keeps 1F1B's peak,
            # p micro-batches, balanced over ranks.
            return min(p, m)
        # DualPipeV (DeepSeek-V3 report, table 2; DualPipe README): PP + 1 chunk activations for 2p chunks.
        return min((2 * p + 1) / 2, m)

    def bubble(self, p: int, v: int, m: int, f: float, b: float, w: float) -> float:
        """Idle time of one pipeline step of m micro-batches, in the units of f, b, w. With fewer
        micro-batches than the schedule needs to fill its pipeline (p, or 2p chunks for the V shapes)
        nothing overlaps the fill and drain: (p - 1)(F + B), as GPipe."""
        if p == 1:
            return 0.0
        if self.name in ("gpipe", "1f1b") or m < (2 * p if self.v_shape else p):
            return (p - 1) * (f + b)  # Huang et al. 2019 (GPipe); Narayanan et al. 2021
        if self.name in ("interleaved_1f1b", "looped_bfs"):
            # Narayanan et al. 2021 sec. 2.2.2; Lamy-Poirier 2023 (breadth-first) has the same bubble.
            return (p - 1) * (f + b) / v
        if self.name == "interleaved_zero_bubble":
            # Qi et al. 2024 (Zero Bubble, ICLR): ZB-H1 shrinks (p-1)(F+B) to (p-1)(F+B-2W); interleaving /v.
            return (p - 1) * max(f + b - 2 * w, 0.0) / v
        if self.name == "zbv_zero_bubble":
            # ZB-V: no bubble when F = B_input = W; otherwise the residue, with half-size chunks.
            return (p - 1) * max(f + b - 3 * w, 0.0) / 2
        # DualPipeV: (PP/2 - 1)(F&B + B - 3W) for PP = 2p chunks of half a rank each; dense models
        # have no all-to-all to overlap, so F&B costs F + B.
        return (p - 1) * max(f + 2 * b - 3 * w, 0.0) / 2


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("gpipe", (1,), holds_all=True),
        Schedule("1f1b", (1,)),
        Schedule("interleaved_1f1b", (2, 4)),
        Schedule("looped_bfs", (2, 4), holds_all=True),
        Schedule("interleaved_zero_bubble", (2, 4)),
        Schedule("zbv_zero_bubble", (2,), v_shape=True),
        Schedule("dualpipev", (2,), v_shape=True),
    )
}
