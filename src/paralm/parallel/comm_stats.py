"""Bytes each rank hands to `torch.distributed`, counted at one layer: the dispatcher's collective ops.

Counting is opt-in (`log.comm_bytes`): off, no mode is entered and nothing here runs in a step.
On, `CommStats.counting()` is entered around the whole job. Every path ends in the same place:
`torch.distributed`'s functions (DDP's reducer, FSDP2's all-gathers and reduce-scatters, pipelining's
sends, our own hooks) dispatch the `c10d::*` ops, and DTensor and the functional collectives dispatch
`_c10d_functional::*`. A `TorchDispatchMode` over those ops therefore sees every collective and
point-to-point call with the tensors actually handed over, in their wire dtype, whatever wrapper
issued it, and adds nothing: no collective, no copy between devices (sizes are read from tensor
metadata). The first op seen is counted, not the ones it runs inside (the mode is off while an op it
intercepted runs), so a functional collective is counted once; an op on DTensors is handed back to
DTensor (`NotImplemented`), whose redistributions then reach the mode as plain collectives. An op of
those namespaces that it does not know fails loudly (a torch upgrade that adds one must add its
convention). Exception: PowerSGD issues its second all-reduce in a future's callback on the
communication thread, where no mode is active; its hook counts PowerSGD's own tally instead
(`paused`, `counting_on`). The mode declares `ignore_compile_internals`, so `torch.compile` still
compiles under it; compiled collectives reach the dispatcher at run time and are counted there.

The mode's price is a Python call for every operator (12-18% of a small model's step on 2 CPU
ranks, `benchmarks/step_time.py`): the reason it is off by default.

What each op counts (a ring all-reduce of n bytes: 2(P-1)/P x n sent per rank, ...) is
`paralm.parallel.wire_volume`'s convention. A step's `comm_bytes` is the traffic of the whole job:
the bytes every rank sent in the step. Traffic between steps (set-up broadcasts, checkpoint loads,
validation, the metrics read-back and the stop-signal agreement) is counted apart, as `other_bytes`
in `comm.json`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from paralm.compat import TorchDispatchMode
from paralm.models.step import StepHook
from paralm.parallel.wire_volume import wire_bytes

SUMMARY_FILE = "comm.json"


class _Counter(TorchDispatchMode):
    """Counts each collective op into `target` (the `CommStats` whose wrapper issued it, else the default)."""

    # Higher-order operators (compiled activation checkpointing's `run_and_save_rng_state`, ...) pass
    # through `__torch_dispatch__` and run whole, uncounted inside: they hold no collectives.
    supports_higher_order_operators = True

    def __init__(self, target: CommStats) -> None:
        super().__init__()
        self.target, self.paused = target, False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # a DTensor's op: its own handling runs first, and its collectives come back here
        volume = None if self.paused else wire_bytes(func, args, kwargs or {})
        if volume is not None:
            self.target.count(*volume)
        return func(*args, **(kwargs or {}))


_active: _Counter | None = None  # the counting mode of this process, while one is entered


def counting_on() -> bool:
    """Whether this process counts bytes now (`log.comm_bytes`): inside `CommStats.counting()`."""
    return _active is not None


@dataclass
class CommStats:
    """This rank's counters: training-step totals since the start, the current step so far, and the
    traffic outside steps (set-up, validation), kept apart so steps show only their own."""

    sent: int = 0
    received: int = 0
    step_sent: int = 0
    step_received: int = 0
    other_sent: int = 0
    other_received: int = 0

    def count(self, sent: float, received: float) -> None:
        self.sent += round(sent)
        self.received += round(received)
        self.step_sent += round(sent)
        self.step_received += round(received)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count every collective issued inside into this object: enters the counting mode (a Python call
        per operator from then on), or, inside one, redirects it here."""
        global _active
        if _active is not None:
            previous, _active.target = _active.target, self
            try:
                yield
            finally:
                _active.target = previous
            return
        with _Counter(self) as _active:
            try:
                yield
            finally:
                _active = None

    @contextlib.contextmanager
    def attributing(self) -> Iterator[None]:
        """While counting is on, count the collectives issued inside into this object; while it is off,
        nothing (no mode is entered)."""
        if _active is None:
            yield
            return
        with self.counting():
            yield

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Issue collectives without counting them (the caller counts their bytes in advance)."""
        counter = _active
        if counter is not None:
            counter.paused = True
        try:
            yield
        finally:
            if counter is not None:
                counter.paused = False

    def take_step(self) -> tuple[int, int]:
        """Bytes (sent, received) since the last call, this rank only."""
        counts = self.step_sent, self.step_received
        self.step_sent = self.step_received = 0
        return counts

    def set_aside(self) -> None:
        """What was counted since the last step is not a step's (set-up, validation): kept apart."""
        self.other_sent += self.step_sent
        self.other_received += self.step_received
        self.sent -= self.step_sent
        self.received -= self.step_received
        self.step_sent = self.step_received = 0

    def summarise(self, world_size: int, steps: int, run_dir: Path | None, device: torch.device) -> str | None:
        """Gather every rank's totals (collective over all ranks, on this rank's `device`, not counted); the
        rank given `run_dir` writes `comm.json` there and gets a one-line summary. `steps`: the steps this
        process ran."""
        mine = torch.tensor(
            [self.sent, self.received, self.other_sent, self.other_received], dtype=torch.float64, device=device
        )
        table = [torch.zeros_like(mine) for _ in range(world_size)]
        if world_size > 1:
            with self.paused():
                dist.all_gather(table, mine)
        else:
            table = [mine]
        if run_dir is None:
            return None
        per_rank = [
            {"rank": r, "sent": int(row[0]), "received": int(row[1]), "other_sent": int(row[2]),
             "other_received": int(row[3])}
            for r, row in enumerate(table)
        ]  # fmt: skip
        total = sum(r["sent"] for r in per_rank)
        summary = {
            "total_bytes": total,
            "steps": steps,
            "bytes_per_step": total / max(steps, 1),
            "other_bytes": sum(r["other_sent"] for r in per_rank),
            "ranks": per_rank,
        }
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        busiest = max(per_rank, key=lambda r: r["sent"] + r["received"])
        return (
            f"communication: {_human(total)} sent by all ranks over {steps} steps "
            f"({_human(total / max(steps, 1))}/step); "
            f"busiest rank {busiest['rank']}: {_human(busiest['sent'])} sent, {_human(busiest['received'])} received"
        )


class StepBytes(StepHook):
    """The counter on the loop's step (`log.comm_bytes`): what was counted before a step began (set-up,
    validation, the metrics read-back, checkpoints, the stop agreement) is set aside, and a step's own bytes
    sent go into its metrics row as `comm_bytes`. Registered last, so it counts the other hooks' collectives."""

    def __init__(self, comm: CommStats) -> None:
        self.comm = comm

    def started(self, step: int) -> None:
        self.comm.set_aside()

    def ended(self, step: int, skipped: torch.Tensor) -> dict[str, int]:
        return {"comm_bytes": self.comm.take_step()[0]}


def _human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
