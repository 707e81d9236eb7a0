"""The parameter server's messages: what crosses between workers and servers, as types.

Every message is a `Header` (a small float64 tensor of its fields), followed for parameters and
gradients by a flat payload in the parameters' dtype. Tags keep the streams apart, so a server can
wait for "the next header from anyone" without taking a payload or a checkpoint transfer instead.

Where they travel: headers are host metadata and always go through the gloo group (`host_group`):
the asynchronous lead server receives "from whichever worker is first", which NCCL cannot do, and a
header's sender is then known. Payloads go on the device group (NCCL on GPUs) when the servers hold
their slice on the workers' kind of device, so GPU workers and GPU servers never copy through the host;
with servers on the CPU (`sync.ps_server_device = "cpu"`) they travel on gloo as CPU tensors, copied
at the worker's end. Each pair of ranks sends payloads in the order it sends headers, so the receiver
of a header knows which payload comes next, whichever group carries it.
"""

from __future__ import annotations

import dataclasses
import enum
import io
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paralm.config.rules import check_server_count
from paralm.config.schema import SyncConfig
from paralm.parallel.comm_stats import CommStats

LEAD = 0  # the server that orders asynchronous updates, writes metrics and checkpoints


class Kind(enum.IntEnum):
    """What a worker's message is."""

    PULL = 0  # send me fresh parameters and tell me what to do next
    PUSH = 1  # here is a gradient (payload follows)
    REPORT = 2  # here is the validation loss


class Status(enum.IntEnum):
    """A server's answer to a pull, or the lead's order to the other servers about a message."""

    RUN = 0
    STOP = 1
    EVALUATE_AND_RUN = 2
    EVALUATE_AND_STOP = 3
    DROP = 4  # a push too stale to apply
    APPLY = 5

    @property
    def evaluates(self) -> bool:
        return self in (Status.EVALUATE_AND_RUN, Status.EVALUATE_AND_STOP)

    @property
    def stops(self) -> bool:
        return self in (Status.STOP, Status.EVALUATE_AND_STOP)


class Tag(enum.IntEnum):
    HEADER = 0
    PAYLOAD = 1
    ORDER = 2  # lead server -> other servers
    STATE = 3  # initial parameters, optimizer state, checkpoint transfers


@dataclass
class Header:
    kind: Kind = Kind.PULL
    status: Status = Status.RUN
    version: int = 0  # updates the parameters had seen (pull answers), or that a gradient was computed on
    start: int = 0  # the batch's first sample
    loss: float = 0.0
    grad_norm: float = 0.0  # asynchronous workers clip their own gradient
    traffic: float = 0.0  # bytes the sender moved since it last reported them
    compute_s: float = 0.0  # seconds the worker spent on the gradient
    val_loss: float = 0.0
    peak_mem: float = 0.0  # a pushing worker's peak memory so far, in bytes
    param_bytes: float = 0.0  # a pushing worker's model states: its parameters and gradients, in bytes
    grad_bytes: float = 0.0
    peer: int = 0  # orders: the worker whose message to handle next

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([float(v) for v in dataclasses.astuple(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, message: torch.Tensor) -> Header:
        values = dict(zip(HEADER_FIELDS, message.tolist(), strict=True))
        return cls(**{name: KINDS[name](value) for name, value in values.items()})


HEADER_FIELDS = tuple(f.name for f in dataclasses.fields(Header))
KINDS = {"kind": lambda v: Kind(int(v)), "status": lambda v: Status(int(v)), "version": int, "start": int, "peer": int}
KINDS |= {name: float for name in HEADER_FIELDS if name not in KINDS}
HEADER_BYTES = len(HEADER_FIELDS) * 8


def server_device(sync: SyncConfig, device: torch.device) -> torch.device:
    """Where the servers hold their slice, given the job's device (`device`: cuda on GPU machines)."""
    return torch.device("cpu") if sync.ps_server_device == "cpu" else device


@dataclass
class Endpoint:
    """This rank's end of the parameter-server messages, counted in `stats` while counting is on: headers
    on `host_group` (gloo), payloads in `device` on `payload_group` (None: the default group)."""

    stats: CommStats
    device: torch.device
    host_group: dist.ProcessGroup | None
    payload_group: dist.ProcessGroup | None

    @classmethod
    def between(cls, stats: CommStats, sync: SyncConfig, device: torch.device, host_group: dist.ProcessGroup | None):
        """The link between workers and servers in a job on `device`: payloads on the device group when
        the servers hold their slice on that kind of device, else on gloo in host memory."""
        on_device = server_device(sync, device).type == device.type
        return cls(stats, device if on_device else torch.device("cpu"), host_group, None if on_device else host_group)

    def send(self, dst: int, head: Header, payload: torch.Tensor | None = None, tag: Tag = Tag.HEADER) -> None:
        with self.stats.attributing():
            dist.send(head.to_tensor(), dst, group=self.host_group, tag=tag)
            if payload is not None:
                dist.send(payload.to(self.device), dst, group=self.payload_group, tag=Tag.PAYLOAD)

    def recv(self, src: int | None, tag: Tag = Tag.HEADER) -> tuple[int, Header]:
        """A header from `src` (from whichever rank sends first when None): (sender, header)."""
        message = torch.empty(len(HEADER_FIELDS), dtype=torch.float64)
        with self.stats.attributing():
            sender = dist.recv(message, src, group=self.host_group, tag=tag)
        return sender, Header.from_tensor(message)

    def recv_payload(self, src: int, like: list[torch.Tensor]) -> torch.Tensor:
        payload = torch.empty(sum(t.numel() for t in like), dtype=like[0].dtype, device=self.device)
        with self.stats.attributing():
            dist.recv(payload, src, group=self.payload_group, tag=Tag.PAYLOAD)
        return payload


def send_object(obj: Any, dst: int, tag: int, group: dist.ProcessGroup | None) -> None:
    """A state dict (tensors, numbers, strings), pickled: its length, then its bytes (CPU tensors:
    `group` must be a gloo group)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=group, tag=tag)
    dist.send(data, dst, group=group, tag=tag)


def recv_object(src: int, tag: int, group: dist.ProcessGroup | None, device: torch.device) -> Any:
    """What `send_object` sent, its tensors on `device` (the receiver's: unmapped, they would land on
    the device they were saved from, another server's GPU)."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, src, group=group, tag=tag)
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(data, src, group=group, tag=tag)
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location=device, weights_only=True)


def shard_bounds(sizes: list[int], servers: int) -> list[range]:
    """Contiguous runs of parameter indices, one per server, of about equal total size."""
    check_server_count(servers, len(sizes))
    total, bounds, running = sum(sizes), [0], 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        cuts_left, tensors_left = servers - len(bounds), len(sizes) - i - 1
        if cuts_left and (running >= total * len(bounds) / servers or tensors_left == cuts_left):
            bounds.append(i + 1)
    return [range(a, b) for a, b in zip(bounds, [*bounds[1:], len(sizes)], strict=True)]
