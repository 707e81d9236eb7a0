"""Step metrics kept on the device until they are read back: one host synchronisation per read-back.

Each step leaves one small vector on its device: its loss sum, gradient norm and whether it was skipped
as they are (device tensors, so nothing waits for the GPU), and the host's counters (bytes sent, memory)
beside them. A read-back stacks the vectors of every step since the last one, reduces them over the
ranks in one collective (`Runtime.reduce_metrics`) and copies the result to the host once.

When: on GPUs every `log.every` steps (and before evaluating, saving or stopping, and after the
first step), so the GPU runs ahead of the host in between; on CPUs the values are on the host
already and every step is read back. Every step still gets its own row in `metrics.jsonl` with its
own loss, gradient norm and bytes; rows are written at the read-back. Host time cannot be split
between steps that were not waited for, so `step_time_s` (and `tokens_per_s`, `mfu`) of each row is
the wall time of its read-back window divided by the steps in it: on CPUs, the step itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from paralm.config.schema import Config
from paralm.hardware import device_peak_flops
from paralm.models.moe import balance_figures
from paralm.models.moe_config import moe_options
from paralm.observe.stragglers import decode
from paralm.parallel.runtime import Runtime
from paralm.train.metrics import Throughput, peak_memory_bytes, step_row


@dataclass
class _Pending:
    step: int
    values: torch.Tensor  # this rank's: sums, then maxima
    host: dict[str, Any]  # the same on every rank: lr, samples seen, loss scale
    predicting: bool = False  # the sums hold multi-token prediction's loss after SUMS


@dataclass
class StepMetrics:
    runtime: Runtime
    throughput: Throughput
    tokens_per_step: int
    loss_divisor: int  # ranks holding a copy of each shard's loss: dp x tp
    every: int  # read back every `every` steps
    comm_bytes: bool = False  # bytes are counted (`log.comm_bytes`): rows carry them, else none
    moe_experts: int = 0  # experts per MoE layer: rows carry the routing balance (`paralm.models.moe`)
    _pending: list[_Pending] = field(default_factory=list)
    _window_start: float | None = None

    SUMS = ("loss", "comm_bytes")
    MAXIMA = ("grad_norm", "skipped", "param_bytes", "grad_bytes", "optim_bytes", "peak_mem_bytes")
    MAXIMA += ("own_slowest", "own_neg_fastest")  # each rank's own time (`paralm.observe.stragglers`)
    ON_DEVICE = ("loss", "grad_norm", "skipped")

    @classmethod
    def of_run(cls, config: Config, runtime: Runtime, flops_per_token: float, tokens_per_step: int) -> StepMetrics:
        """The metrics of a training run: its throughput against the device's peak, its rows' contents."""
        peak_flops = device_peak_flops(runtime.device, config.precision.dtype)
        return cls(
            runtime,
            Throughput(flops_per_token, peak_flops, runtime.world_size),
            tokens_per_step=tokens_per_step,
            loss_divisor=runtime.dims.loss_replicas,  # each loss is held by the tp ranks of the last stage
            every=config.log.every if runtime.device.type == "cuda" else 1,  # on CPUs reading back costs nothing
            comm_bytes=config.log.comm_bytes,
            moe_experts=moe.experts if (moe := moe_options(config.model)) else 0,
        )

    def start_step(self) -> None:
        if self._window_start is None:
            self._window_start = time.perf_counter()

    def add(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        skipped: torch.Tensor | None,
        values: dict[str, Any],
    ) -> None:
        """Record a step without waiting for the device. `skipped`: the bad-step flag, on the device (None: the
        step cannot be skipped that way). `values`: the step hooks' figures and the loop's, by name: the
        `MAXIMA` counters (host integers: memory, own time; peak memory is taken here), `comm_bytes` (the
        step's bytes sent, summed over ranks, when counted), `moe` (the step's routing statistics, on the
        device, summed over ranks: `paralm.models.moe.take_statistics`), `mtp_loss` (multi-token prediction's,
        on the device, summed over ranks as the loss: `paralm.models.mtp`); any other name is a host value the
        row carries as it is (lr, samples seen, loss scale)."""
        counted = set(self.SUMS + self.MAXIMA)
        counters = {k: v for k, v in values.items() if k in counted}
        host = {k: v for k, v in values.items() if k not in counted and k not in ("moe", "mtp_loss")}
        counters["peak_mem_bytes"] = peak_memory_bytes(self.runtime.device)
        on_host = torch.tensor(
            [counters.get("comm_bytes", 0), *(counters[k] for k in self.MAXIMA if k not in self.ON_DEVICE)],
            dtype=torch.float64,
        )
        if self.runtime.device.type == "cuda":
            on_host = on_host.pin_memory()  # a copy from pinned memory does not block the host
        on_host = on_host.to(self.runtime.device, non_blocking=True)
        flag = torch.zeros((), dtype=torch.float64, device=loss.device) if skipped is None else skipped.double()
        device = torch.stack([loss.detach().double(), grad_norm.detach().double(), flag])
        routing = [values["moe"].double()] if "moe" in values else []
        if "mtp_loss" in values:
            routing.insert(0, values["mtp_loss"].to(loss.device, torch.float64).view(1))
        row = torch.cat([device[:1], on_host[:1], *routing, device[1:], on_host[1:]])  # SUMS, mtp, moe, MAXIMA
        self._pending.append(_Pending(step, row, host, "mtp_loss" in values))

    def due(self, steps_done: int) -> bool:
        return steps_done % self.every == 0

    def read_back(self) -> list[dict[str, Any]]:
        """Every pending step's row, reduced over the ranks (a collective: every rank calls it at the same step)."""
        if not self._pending:
            return []
        table = torch.stack([p.values for p in self._pending])
        sums = table.shape[1] - len(self.MAXIMA)  # SUMS and the routing statistics
        reduced = self.runtime.reduce_metrics(table, sums).tolist()
        seconds = (time.perf_counter() - self._window_start) / len(self._pending)
        rows = []
        for pending, values in zip(self._pending, reduced, strict=True):
            routing = values[len(self.SUMS) : sums]
            ahead = {"mtp_loss": routing.pop(0) / self.loss_divisor} if pending.predicting else {}
            values = values[: len(self.SUMS)] + values[sums:]
            named = dict(zip(self.SUMS + self.MAXIMA, values, strict=True))
            loss, grad_norm, comm_bytes, skipped = (
                named.pop(k) for k in ("loss", "grad_norm", "comm_bytes", "skipped")
            )
            host = pending.host | ({"skipped": True} if skipped else {})
            own = decode(named.pop("own_slowest"), named.pop("own_neg_fastest"), self.runtime.world_size)
            trained = host.pop("trained_tokens", None)  # with a loss mask: the targets it trained on
            if trained is not None:
                host["trained_tokens_per_s"] = trained / seconds
            rows.append(
                step_row(
                    pending.step,
                    loss / self.loss_divisor,
                    host.pop("lr"),
                    None if host.get("overflow") else grad_norm,  # an overflow has none (a skip: `BadSteps.review`)
                    **self.throughput.row(self.tokens_per_step, seconds),
                    **own,
                    **{k: int(v) for k, v in named.items()},
                    **host,
                    **ahead,
                    **({"comm_bytes": int(comm_bytes)} if self.comm_bytes else {}),
                    **(
                        balance_figures(routing, self.loss_divisor, self.moe_experts, self.runtime.dims.tp)
                        if routing
                        else {}
                    ),
                )
            )
        self._pending, self._window_start = [], None
        return rows
