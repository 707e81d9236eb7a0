"""Bytes each rank hands to `torch.distributed` to keep replicas in sync, counted at the call.

Every synchronisation path (DDP communication hooks, model averaging, parameter-server messages)
sends through the counting wrappers here, so the figures are the sizes of the tensors actually
handed over, in their wire dtype. Convention for collectives: an all-reduce of n bytes over P ranks
is counted as a ring all-reduce, 2(P-1)/P x n sent and as much received per rank; an all-gather of
n bytes per rank as (P-1) x n sent and received. Point-to-point messages count their size at both
ends. A step's `comm_bytes` is the network traffic of the whole job: the bytes all ranks sent.
Metrics traffic (loss, memory peaks, these counters themselves) is not synchronisation and is not
counted.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SUMMARY_FILE = "comm.json"


@dataclass
class CommStats:
    """This rank's counters: totals since the start, and what the current step has sent so far."""

    sent: int = 0
    received: int = 0
    step_sent: int = 0
    step_received: int = 0

    def count(self, sent: float, received: float) -> None:
        self.sent += round(sent)
        self.received += round(received)
        self.step_sent += round(sent)
        self.step_received += round(received)

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False) -> Any:
        """`dist.all_reduce` (sum), counted."""
        size = dist.get_world_size(group)
        ring = 2 * (size - 1) / size * tensor.numel() * tensor.element_size()
        self.count(ring, ring)
        return dist.all_reduce(tensor, group=group, async_op=async_op)

    def all_gather(
        self, outputs: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
    ) -> Any:
        """`dist.all_gather`, counted."""
        ring = (dist.get_world_size(group) - 1) * tensor.numel() * tensor.element_size()
        self.count(ring, ring)
        return dist.all_gather(outputs, tensor, group=group, async_op=async_op)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, group: dist.ProcessGroup | None = None) -> None:
        self.count(tensor.numel() * tensor.element_size(), 0)
        dist.send(tensor, dst, group=group, tag=tag)

    def recv(
        self, tensor: torch.Tensor, src: int | None = None, tag: int = 0, group: dist.ProcessGroup | None = None
    ) -> int:
        """Receive into `tensor` from `src` (from whichever rank sends first when None); returns the sender."""
        sender = dist.recv(tensor, src, group=group, tag=tag)
        self.count(0, tensor.numel() * tensor.element_size())
        return sender

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

    def take_step(self) -> tuple[int, int]:
        """Bytes (sent, received) since the last call, this rank only."""
        counts = self.step_sent, self.step_received
        self.step_sent = self.step_received = 0
        return counts

    def summarise(self, world_size: int, steps: int, run_dir: Path | None, device: torch.device) -> str | None:
        """Gather every rank's totals (collective over all ranks, on this rank's `device`); the rank given
        `run_dir` writes `comm.json` there and gets a one-line summary. `steps`: the steps this process ran."""
        mine = torch.tensor([self.sent, self.received], dtype=torch.float64, device=device)
        table = [torch.zeros_like(mine) for _ in range(world_size)]
        if world_size > 1:
            dist.all_gather(table, mine)
        else:
            table = [mine]
        if run_dir is None:
            return None
        per_rank = [{"rank": r, "sent": int(row[0]), "received": int(row[1])} for r, row in enumerate(table)]
        total = sum(r["sent"] for r in per_rank)
        summary = {"total_bytes": total, "steps": steps, "bytes_per_step": total / max(steps, 1), "ranks": per_rank}
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
