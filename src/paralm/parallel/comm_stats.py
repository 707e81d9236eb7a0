"""Bytes each rank hands to `torch.distributed`, counted at one layer: the dispatcher's collective ops.

Every path ends in the same place: `torch.distributed`'s functions (DDP's reducer, FSDP2's
all-gathers and reduce-scatters, pipelining's sends, our own hooks) dispatch the `c10d::*` ops, and
DTensor and the functional collectives dispatch `_c10d_functional::*`. A `TorchDispatchMode` over
those ops (`CommStats.counting()`) therefore sees every collective and point-to-point call with the
tensors actually handed over, in their wire dtype, whatever wrapper issued it, and adds nothing:
no collective, no copy between devices (sizes are read from tensor metadata). The first op seen is
counted, not the ones it runs inside (the mode is off while an op it intercepted runs), so a
functional collective is counted once; an op on DTensors is handed back to DTensor (`NotImplemented`),
whose redistributions then reach the mode as plain collectives. An op of those namespaces that it
does not know fails loudly (a torch upgrade that adds one must add its convention). Exception:
PowerSGD issues its second all-reduce in a future's callback on the communication thread, where no
mode is active; its hook counts PowerSGD's own tally instead. The mode declares
`ignore_compile_internals`, so `torch.compile` still compiles under it; compiled collectives reach
the dispatcher at run time and are counted there.

The mode's price is a Python call for every operator (12–18% of a small model's step on 2 CPU ranks).
Where every collective of some work is issued through this module's methods, each counting itself,
the work runs with the mode suspended (`CommStats.suspended`): the forward and backward of layouts
without tensor parallelism, whose communication there is DDP's reducer (its comm hook is ours),
FSDP2's (its custom all-gather and reduce-scatter are ours, and the hook it calls after HSDP's
all-reduce counts that, `count_all_reduce_issued_by_torch`) or, after the first step (which exchanges
the stages' shapes), a pipeline schedule's transfers (its stages count what they hand the schedule,
`count_p2p_issued_by_torch`); ZeRO-1's exchange after backward and after the optimizer step, whose
per-parameter work would otherwise cost ~12% of the tiny model's step (`benchmarks/comm_counter.py
--zero 1`); and in every layout the optimizer step, which communicates nothing (~10% of the tiny
model's tensor-parallel step, `--tp 2`). Not counted then: DDP's one-time exchange of its rebuilt
bucket order, in the second step's forward (152 bytes for the tiny model on 2 ranks).

What each op counts (a ring all-reduce of n bytes: 2(P-1)/P x n sent per rank, ...) is
`paralm.parallel.wire_volume`'s convention. A step's `comm_bytes` is the traffic of the whole job:
the bytes every rank sent in the step. Traffic between steps (set-up broadcasts, checkpoint loads,
validation, the metrics read-back and the stop-signal agreement) is counted apart, as `other_bytes`
in `comm.json`.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from paralm.compat import TorchDispatchMode, current_dispatch_mode
from paralm.parallel.wire_volume import RULES, tensor_bytes, wire_bytes

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
        """Count every collective issued inside into this object (nested: redirected to it)."""
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
    def suspended(self) -> Iterator[None]:
        """Leave the counting mode for work whose collectives all go through this object's methods (each
        counts itself), so its other operators skip the mode's Python dispatch. With another mode inside
        ours (it cannot be taken off from under that one), counting simply goes on."""
        global _active
        counter = _active
        if counter is None or current_dispatch_mode() is not counter:
            yield
            return
        counter.__exit__(None, None, None)
        _active = None  # the methods enter a mode of their own meanwhile
        try:
            yield
        finally:
            _active = counter
            counter.__enter__()

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

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False) -> Any:
        """`dist.all_reduce` (sum), counted here."""
        with self.counting():
            return dist.all_reduce(tensor, group=group, async_op=async_op)

    def all_gather(
        self, outputs: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
    ) -> Any:
        """`dist.all_gather`, counted here."""
        with self.counting():
            return dist.all_gather(outputs, tensor, group=group, async_op=async_op)

    def all_gather_single(
        self, output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
    ) -> Any:
        """`dist.all_gather_single` (into one tensor), counted here."""
        with self.counting():
            return dist.all_gather_single(output, tensor, group=group, async_op=async_op)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType,
        group: dist.ProcessGroup | None,
        async_op: bool = False,
    ) -> Any:
        """`dist.reduce_scatter_single` (from one tensor), counted here."""
        with self.counting():
            return dist.reduce_scatter_single(output, tensor, op=op, group=group, async_op=async_op)

    def count_all_reduce_issued_by_torch(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Count an all-reduce of `tensor` that torch issued itself (FSDP2's HSDP all-reduce, which takes
        no custom collective) and that no counting mode saw (with one active, it was counted there)."""
        if _active is None:
            self.count(*RULES["all_reduce"][1](tensor_bytes(tensor), group.size(), False))

    def count_p2p_issued_by_torch(self, ops: list[dist.P2POp]) -> None:
        """Count the point-to-point ops a pipeline schedule is about to issue (each sends or receives
        its tensor) where no counting mode will see them (with one active, it counts them there)."""
        if _active is None:
            for op in ops:
                n = tensor_bytes(op.tensor)
                self.count(*((n, 0) if op.op is dist.isend else (0, n)))

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, group: dist.ProcessGroup | None = None) -> None:
        with self.counting():
            dist.send(tensor, dst, group=group, tag=tag)

    def recv(
        self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, group: dist.ProcessGroup | None = None
    ) -> int:
        """Receive into `tensor` from `src` (from whichever rank sends first when None); returns the sender."""
        with self.counting():
            return dist.recv(tensor, src, group=group, tag=tag)

    def send_object(self, obj: Any, dst: int, tag: int = 0, group: dist.ProcessGroup | None = None) -> None:
        """A state dict (tensors, numbers, strings), pickled: its length, then its bytes (CPU tensors:
        `group` must be a gloo group)."""
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        self.send(torch.tensor([data.numel()], dtype=torch.int64), dst, tag, group)
        self.send(data, dst, tag, group)

    def recv_object(self, src: int, tag: int = 0, group: dist.ProcessGroup | None = None) -> Any:
        length = torch.zeros(1, dtype=torch.int64)
        self.recv(length, src, tag, group)
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        self.recv(data, src, tag, group)
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)

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


def _human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
