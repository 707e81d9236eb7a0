"""The pipeline schedules paralm runs: one table, read by the config (its choices), the rules, the
pipeline (which torch class, which stage layout) and the planner (which micro-batch counts).

The constraints restate what `torch.distributed.pipelining`'s constructors require (torch 2.13), so a
wrong combination is one readable line before any process starts instead of a ValueError per rank.
This module imports nothing from paralm: everything else may depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSchedule:
    name: str  # the value of `parallel.pp_schedule`
    torch_class: str  # in `torch.distributed.pipelining.schedules`
    stages_per_rank: str  # "one"; "v": exactly two, in a V (first and last stage on one rank); "looped": any

    @property
    def fewest_stages_per_rank(self) -> int:
        """The fewest model chunks per rank (`parallel.pp_virtual_stages`) that exercise the schedule: 1 for
        the single-stage ones, 2 for the V ones (they need it) and the looped ones (which run with 1 too,
        but then have nothing to interleave)."""
        return 1 if self.stages_per_rank == "one" else 2

    def fewest_microbatches(self, pp: int, stages: int) -> int:
        """1F1B needs one micro-batch per rank, DualPipeV one per stage."""
        return {"1f1b": pp, "dualpipev": stages}.get(self.name, 1)

    def microbatch_rounds(self, pp: int, microbatches: int) -> int | None:
        """The interleaved schedules run micro-batches in rounds: the count must be a multiple of this."""
        if self.name in ("interleaved_1f1b", "interleaved_zero_bubble"):
            return max(1, microbatches // pp)
        return None


PIPELINE_SCHEDULES: dict[str, PipelineSchedule] = {
    s.name: s
    for s in (
        PipelineSchedule("gpipe", "ScheduleGPipe", "one"),
        PipelineSchedule("1f1b", "Schedule1F1B", "one"),
        PipelineSchedule("interleaved_1f1b", "ScheduleInterleaved1F1B", "looped"),
        PipelineSchedule("looped_bfs", "ScheduleLoopedBFS", "looped"),
        PipelineSchedule("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", "looped"),
        PipelineSchedule("zbv_zero_bubble", "ScheduleZBVZeroBubble", "v"),
        PipelineSchedule("dualpipev", "ScheduleDualPipeV", "v"),
    )
}


def fewest_stages_per_rank(schedule: str) -> int:
    return PIPELINE_SCHEDULES[schedule].fewest_stages_per_rank
