"""The lead parameter server's metrics: one row per update, with (while counting, `log.comm_bytes`)
`comm_bytes` = the bytes all ranks sent for it (workers report their traffic in their headers, since
every worker-server byte has a worker at one end, and servers add their server-to-server bytes);
`param_bytes` and `grad_bytes` are the model states of the largest worker, as its pushes report them.
Checkpoint transfers appear in the end-of-run summary only; evaluation runs on the workers and the
first one reports the loss."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from paralm.config.schema import Config
from paralm.data.sampler import BatchLayout
from paralm.hardware import device_peak_flops, startup_notes
from paralm.models.registry import model_shape
from paralm.parallel.runtime import Runtime
from paralm.param_server.protocol import HEADER_BYTES, Endpoint, Kind, server_device
from paralm.param_server.shard import ServerShard
from paralm.train.metrics import Throughput, banner, open_run_log, peak_memory_bytes, step_row
from paralm.train.optim.schedule import learning_rate


class ServerLog:
    def __init__(
        self, config: Config, runtime: Runtime, shard: ServerShard, link: Endpoint, layout: BatchLayout
    ) -> None:
        self.config, self.shard, self.link, self.layout = config, shard, link, layout
        self.update_batch = layout.global_batch
        self.run_dir = Path(config.run.dir)
        peak = device_peak_flops(runtime.device, config.precision.dtype)
        # MFU over the devices that compute: the workers (the servers only apply updates)
        flops = model_shape(config.model).flops_per_token
        self.throughput = Throughput(flops, peak, runtime.world_size - runtime.servers)
        self.pending_traffic = 0.0  # reported by workers, not yet in a row
        self.worker_peak_mem = 0  # the largest peak a worker reported
        # the largest model states a worker reported (no optimizer state: the servers step)
        self.worker_states = {"param_bytes": 0, "grad_bytes": 0}
        self.device = server_device(config.sync, runtime.device)
        self.logger = open_run_log(config, shard.version)
        self.logger.message(banner(self._describe(runtime), shard.version, config.train.steps))
        for note in startup_notes(runtime.device, config.precision.dtype):
            self.logger.message(note)
        self.last_time = self.start_time = time.perf_counter()
        self.first_version = shard.version

    def _describe(self, runtime: Runtime) -> str:
        s, t, b = self.config.sync, self.config.train, self.layout
        how = (
            f"asynchronous (max staleness {s.max_staleness}), {b.global_batch} sequences per update"
            + ("; validation and checkpoints at the end only" if t.eval_every or self.config.checkpoint.every else "")
            if s.ps_async
            else f"synchronous, global batch {b.global_batch} = {b.dp_size} x {b.grad_accum} x {b.micro_batch_size} "
            "sequences"
        )
        return (
            f"parameter server, {model_shape(self.config.model).flops_params / 1e6:.2f}M parameters on "
            f"{runtime.servers} "
            f"server(s), {runtime.dims.dp} worker(s) on {runtime.device.type}, {how}"
        )

    def row(self, loss: float, grad_norm: float, server_traffic: float) -> dict[str, Any]:
        now = time.perf_counter()
        step_time, self.last_time = now - self.last_time, now
        if self.config.sync.ps_async:  # updates arrive in bursts (queued pushes): the mean time per update so far
            step_time = (now - self.start_time) / (self.shard.version - self.first_version)
        traffic, self.pending_traffic = self.pending_traffic + server_traffic, 0.0
        step = self.shard.version - 1
        return step_row(
            step,
            loss,
            learning_rate(step, self.config.train),
            grad_norm,
            **self.throughput.row(self.update_batch * self.config.model.block_size, step_time),
            samples_seen=self.shard.samples_seen,
            **({"comm_bytes": traffic} if self.config.log.comm_bytes else {}),
            # other servers hold a slice of the same size as this one: the largest peak is a worker's or ours
            peak_mem_bytes=max(self.worker_peak_mem, peak_memory_bytes(self.device)),
            **self.worker_states,
        )

    def await_report(self) -> dict[str, float]:
        first_worker = self.shard.servers
        _, head = self.link.recv(first_worker)
        if head.kind != Kind.REPORT:
            raise RuntimeError(f"parameter server: expected rank {first_worker}'s evaluation report")
        # the report itself, and what the workers said since the last row (asynchronous: after the last update)
        traffic, self.pending_traffic = head.traffic + HEADER_BYTES + self.pending_traffic, 0.0
        return {"val_loss": head.val_loss, "traffic": traffic}

    def write(self, row: dict[str, Any]) -> None:
        traffic = row.pop("traffic", 0)
        if self.config.log.comm_bytes:
            row["comm_bytes"] = int(row["comm_bytes"] + traffic)
        self.logger.write(row)
        self.logger.progress(row)

    def message(self, text: str) -> None:
        self.logger.message(text)

    def close(self, summary: str | None) -> None:
        if summary:
            self.logger.message(summary)
        self.logger.close()
