"""Parameter server: ranks 0..k-1 (`sync.ps_servers` = k) hold the parameters and optimizer state,
sharded; the other ranks are workers that pull parameters, compute gradients and push them.

It runs on `torch.distributed` point-to-point messages (tagged send/recv), launched by torchrun like
every other mode. A message is a small float64 header of named fields and, for parameters and
gradients, a flat payload in the parameters' dtype. The parameters are cut, in model order, into k
runs of about equal size; server s owns run s, holds optimizer state for it alone and is the only one
to step it (the lead server also keeps a copy of the others' runs, refreshed at checkpoints).

Synchronous (`sync.ps_async = false`): a step waits for every worker's gradient; the servers average
them as DDP's all-reduce does (divide by the workers, sum in rank order), clip by the norm of the
whole averaged gradient (servers add up their squared run norms) and step: the same training as
all-reduce data parallelism over the workers.

Asynchronous: the lead server (rank 0) takes messages in arrival order and forwards that order to the
other servers, so every run sees the same sequence of updates. A gradient computed on parameters
`s` updates old (its staleness) is applied as soon as it arrives if s <= `sync.max_staleness`;
otherwise it is dropped, its batch is queued for the next pull, and the worker that fell that far
behind restarts from fresh parameters: it waits, the others never do. Each worker clips its own
gradient, as a one-process step would. A step (`train.steps`, the lr schedule) is one update, of one
worker's batch: an asynchronous run sees 1/workers of the samples of a synchronous run of as many steps.

The lead server writes the metrics, one row per update (asynchronous: with its staleness and worker),
with `comm_bytes` = the bytes all ranks sent for it: workers report their traffic in their headers
(every worker-server byte has a worker at one end) and servers add their server-to-server bytes.
Checkpoint transfers appear in the end-of-run summary only. Evaluation runs on the workers (at
`train.eval_every` and the end when synchronous, at the end when not: asynchronous workers hold
different parameters until then) and the first worker reports the loss. For a checkpoint the other
servers send their runs to the lead, which writes an ordinary checkpoint that any mode loads.

A rank that dies closes its connections, so its peers' sends and receives fail at once and torchrun
stops the job; the launcher names the rank that failed first.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paralm.config import Config
from paralm.data.prepare import dataset_dir
from paralm.data.sampler import BatchLayout
from paralm.errors import UserError
from paralm.hardware import device_peak_flops
from paralm.model import GPT
from paralm.parallel.comm_stats import CommStats
from paralm.parallel.flat import flatten, unflatten
from paralm.parallel.runtime import Runtime
from paralm.parallel.sync import SyncStrategy, TrainingState
from paralm.train.checkpoint import (
    checkpoint_to_resume,
    load_checkpoint,
    save_checkpoint,
    trainer_state,
)
from paralm.train.metrics import MetricsLogger
from paralm.train.optim import build_optimizer, learning_rate, set_learning_rate
from paralm.train.trainer import RESOLVED_CONFIG, Trainer

FIELDS = ("kind", "status", "version", "start", "loss", "grad_norm", "traffic", "compute_s", "val_loss", "peer")
PULL, PUSH, REPORT = 0, 1, 2  # what a worker's message is
RUN, STOP, EVALUATE_AND_RUN, EVALUATE_AND_STOP = 0, 1, 2, 3  # a server's answer to a pull
DROP, APPLY = 4, 5  # the lead's order to the other servers for a push
HEADER_TAG, PAYLOAD_TAG, ORDER_TAG, STATE_TAG = 0, 1, 2, 3
LEAD = 0


def header(**values: float) -> torch.Tensor:
    return torch.tensor([float(values.get(name, 0.0)) for name in FIELDS], dtype=torch.float64)


def shard_bounds(sizes: list[int], servers: int) -> list[range]:
    """Contiguous runs of parameter indices, one per server, of about equal total size."""
    if len(sizes) < servers:
        raise UserError(f"sync.ps_servers = {servers} exceeds the model's {len(sizes)} parameter tensors")
    total, bounds, running = sum(sizes), [0], 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        cuts_left, tensors_left = servers - len(bounds), len(sizes) - i - 1
        if cuts_left and (running >= total * len(bounds) / servers or tensors_left == cuts_left):
            bounds.append(i + 1)
    return [range(a, b) for a, b in zip(bounds, [*bounds[1:], len(sizes)], strict=True)]


@dataclasses.dataclass
class Link:
    """This rank's end of the parameter-server messages, counted in `stats`."""

    stats: CommStats
    device: torch.device

    def send(self, dst: int, head: torch.Tensor, payload: torch.Tensor | None = None, tag: int = HEADER_TAG) -> None:
        self.stats.send(head, dst, tag)
        if payload is not None:
            self.stats.send(payload, dst, PAYLOAD_TAG)

    def recv(self, src: int | None, tag: int = HEADER_TAG) -> tuple[int, dict[str, float]]:
        """A header from `src` (from whichever rank sends first when None): (sender, its fields)."""
        message = torch.empty(len(FIELDS), dtype=torch.float64)
        sender = self.stats.recv(message, src, tag)
        return sender, dict(zip(FIELDS, message.tolist(), strict=True))

    def recv_payload(self, src: int, like: list[torch.Tensor]) -> torch.Tensor:
        payload = torch.empty(sum(t.numel() for t in like), dtype=like[0].dtype, device=self.device)
        self.stats.recv(payload, src, PAYLOAD_TAG)
        return payload


def run_parameter_server(config: Config, runtime: Runtime) -> None:
    """Every rank of a parameter-server job: servers serve, workers compute."""
    if config.sync.ps_async and runtime.device.type != "cpu":
        raise UserError("sync.ps_async = true receives from whichever worker is first, which needs gloo: use CPUs")
    if runtime.local_rank == 0:  # a server here, which builds no Trainer: it prepares the data for the workers'
        dataset_dir(config.data)
    solo = dist.new_group([LEAD])  # the lead server writes checkpoints alone; every rank takes part in creating it
    dist.barrier()
    if runtime.is_server:
        Server(config, runtime, solo).serve()
    else:
        Worker(Trainer(config, runtime), config, runtime).work()


class Worker:
    def __init__(self, trainer: Trainer, config: Config, runtime: Runtime) -> None:
        self.trainer, self.config, self.runtime = trainer, config, runtime
        self.link = Link(runtime.comm, runtime.device)
        self.params = list(trainer.model.parameters())
        bounds = shard_bounds([p.numel() for p in self.params], runtime.servers)
        self.shards = [self.params[b.start : b.stop] for b in bounds]
        t = config.train
        if config.sync.ps_async:  # an update is one worker's batch
            self.layout, self.dp_rank = BatchLayout(1, t.grad_accum, t.micro_batch_size), 0
        else:  # an update is the global batch, each worker taking its slice as in all-reduce data parallelism
            self.layout, self.dp_rank = trainer.layout, runtime.dp_rank
        self.first = runtime.rank == runtime.servers

    def work(self) -> None:
        self._work()
        self.runtime.comm.summarise(self.runtime.world_size, 0, None)  # collective: the lead server writes it

    def _work(self) -> None:
        if self.first:  # the servers start from this worker's parameters (initialised, or restored by the Trainer)
            for server, shard in enumerate(self.shards):
                self.link.send(server, header(), flatten([p.detach() for p in shard]), STATE_TAG)
        reply = self.pull()
        while True:
            if reply["status"] in (EVALUATE_AND_RUN, EVALUATE_AND_STOP):
                self.report(self.trainer.evaluate())
            if reply["status"] in (STOP, EVALUATE_AND_STOP):
                return
            self.push(*self.compute(int(reply["version"]), int(reply["start"])), reply)
            reply = self.pull()

    def compute(self, version: int, start: int) -> tuple[float, float, float]:
        """Gradients of this worker's batch at `start`: (loss, grad norm (async only), seconds)."""
        started = time.perf_counter()
        self.trainer.plan.before_step(self.config.train.seed, version)
        batches = self.trainer.micro_batches(self.layout.micro_batch_starts(start, self.dp_rank))
        loss = self.trainer.forward_backward(batches).item()
        grad_norm = 0.0
        if self.config.sync.ps_async:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.train.grad_clip or float("inf")).item()
        return loss, grad_norm, time.perf_counter() - started

    def _traffic(self) -> int:
        """Bytes this worker sent and received since it last told the lead server."""
        return sum(self.runtime.comm.take_step())

    def push(self, loss: float, grad_norm: float, seconds: float, reply: dict[str, float]) -> None:
        for server, shard in enumerate(self.shards):
            message = header(
                kind=PUSH,
                version=reply["version"],
                start=reply["start"],
                loss=loss,
                grad_norm=grad_norm,
                compute_s=seconds,
                traffic=self._traffic() if server == LEAD else 0,
            )
            self.link.send(server, message, flatten([p.grad for p in shard]))
        self.trainer.model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def pull(self) -> dict[str, float]:
        """Fresh parameters from every server; returns the lead's answer (what to do next)."""
        for server in range(len(self.shards)):
            self.link.send(server, header(kind=PULL, traffic=self._traffic() if server == LEAD else 0))
        answers = []
        for server, shard in enumerate(self.shards):
            answers.append(self.link.recv(server)[1])
            flat = self.link.recv_payload(server, shard)
            for p, value in zip(shard, unflatten(flat, shard), strict=True):
                p.copy_(value)
        return answers[LEAD]

    def report(self, val_loss: float) -> None:
        """After an evaluation (collective over the workers) the first worker sends the loss to the lead
        server, with all workers' traffic not yet reported."""
        traffic = self.runtime.all_reduce(torch.tensor([float(self._traffic())], dtype=torch.float64))
        if self.first:
            self.link.send(LEAD, header(kind=REPORT, val_loss=val_loss, traffic=traffic.item()))


class Server:
    def __init__(self, config: Config, runtime: Runtime, solo: dist.ProcessGroup) -> None:
        self.config, self.runtime, self.solo = config, runtime, solo
        self.lead = runtime.rank == LEAD
        self.link = Link(runtime.comm, runtime.device)
        self.peers = CommStats()  # server-to-server bytes, kept apart: the workers report all others
        self.peer_link = Link(self.peers, runtime.device)
        self.servers, self.workers = runtime.servers, runtime.dims.dp
        self.model = GPT(config.model).to(runtime.device)  # the whole structure; only the owned run is stepped
        self.params = list(self.model.parameters())
        self.bounds = shard_bounds([p.numel() for p in self.params], self.servers)
        self.owned = self.params[self.bounds[runtime.rank].start : self.bounds[runtime.rank].stop]
        self.optimizer = build_optimizer(self.model, config.train)  # it keeps state only for what it steps
        if not self.lead:  # which is only the owned run: drop the rest (the lead keeps it, to write checkpoints)
            for p in self.params[: self.bounds[runtime.rank].start] + self.params[self.bounds[runtime.rank].stop :]:
                p.data = p.data.new_empty(0)
        t = config.train
        self.per_push = t.grad_accum * t.micro_batch_size
        self.update_batch = self.per_push * (1 if config.sync.ps_async else self.workers)
        self.version = self.samples_seen = 0
        self._receive_initial_state()
        self.first_version = self.version
        self.next_sample = self.samples_seen  # asynchronous: the next batch to hand out
        self.pending_traffic = 0.0  # reported by workers, not yet in a row
        self.logger = self._open_log() if self.lead else None
        self.last_time = time.perf_counter()

    # --- state: initial parameters, resume, checkpoints -------------------------------------------------

    @torch.no_grad()
    def _receive_initial_state(self) -> None:
        first_worker = self.servers
        self.link.recv(first_worker, STATE_TAG)
        flat = self.link.recv_payload(first_worker, self.owned)
        for p, value in zip(self.owned, unflatten(flat, self.owned), strict=True):
            p.copy_(value)
        if self.lead:
            self._restore()
            for server in range(1, self.servers):
                state = {"version": self.version, "samples_seen": self.samples_seen, "optim": self._run_state(server)}
                self.peers.send_object(state, server, STATE_TAG)
        else:
            state = self.peers.recv_object(LEAD, STATE_TAG)
            self.version, self.samples_seen = state["version"], state["samples_seen"]
            self._set_state(state["optim"])
        self.peers.take_step()  # not synchronisation traffic: in the summary, not in a row

    def _restore(self) -> None:
        path = checkpoint_to_resume(self.config)
        if path is None:
            return
        state = load_checkpoint(path, TrainingState(self.model, self.optimizer, SyncStrategy()), self.solo)
        self.version, self.samples_seen = int(state["step"]), int(state["samples_seen"])

    def _run_state(self, server: int) -> dict[int, dict[str, Any]]:
        """Optimizer state of server `server`'s run, by parameter index."""
        return {
            i: self.optimizer.state[self.params[i]]
            for i in self.bounds[server]
            if self.params[i] in self.optimizer.state
        }

    def _set_state(self, state: dict[int, dict[str, Any]]) -> None:
        for index, values in state.items():
            self.optimizer.state[self.params[index]] = values

    @torch.no_grad()
    def _checkpoint(self) -> None:
        """Collective over the servers: the others send their runs to the lead, which writes them all."""
        if not self.lead:
            run = {i: self.params[i].detach() for i in self.bounds[self.runtime.rank]}
            self.peers.send_object({"params": run, "optim": self._run_state(self.runtime.rank)}, LEAD, STATE_TAG)
            self.peers.take_step()
            return
        for server in range(1, self.servers):
            shard = self.peers.recv_object(server, STATE_TAG)
            for index, value in shard["params"].items():
                self.params[index].copy_(value)
            self._set_state(shard["optim"])
        state = trainer_state(self.version, self.samples_seen, self.config.model.block_size, self.runtime.world_size)
        alone = dataclasses.replace(self.runtime, group=self.solo)
        path = save_checkpoint(
            self.config.run.dir,
            self.version,
            TrainingState(self.model, self.optimizer, SyncStrategy()),
            state,
            self.config,
            alone,
            keep=self.config.checkpoint.keep,
        )
        self.logger.message(f"saved {path}")

    # --- serving -----------------------------------------------------------------------------------------

    def serve(self) -> None:
        if self.logger and self.version >= self.config.train.steps:
            self.logger.message(f"nothing to do: the checkpoint is at step {self.version}")
        (self._serve_async if self.config.sync.ps_async else self._serve_sync)()
        self.runtime.comm.sent += self.peers.sent
        self.runtime.comm.received += self.peers.received
        run_dir = Path(self.config.run.dir) if self.logger else None
        line = self.runtime.comm.summarise(self.runtime.world_size, self.version - self.first_version, run_dir)
        if self.logger:
            self.logger.message(line)
            self.logger.close()

    def _workers(self) -> range:
        return range(self.servers, self.runtime.world_size)

    def _serve_sync(self) -> None:
        t, ckpt = self.config.train, self.config.checkpoint
        self._answer_pulls(RUN if self.version < t.steps else STOP)
        while self.version < t.steps:
            grads = torch.zeros(
                sum(p.numel() for p in self.owned), dtype=self.owned[0].dtype, device=self.runtime.device
            )
            loss = 0.0
            for worker in self._workers():  # in rank order, like the all-reduce's sum
                _, head = self.link.recv(worker)
                grads.add_(self.link.recv_payload(worker, self.owned).div_(self.workers))
                loss += head["loss"]
                self.pending_traffic += head["traffic"]
            grad_norm = self._step(grads, clip=t.grad_clip)
            last = self.version == t.steps
            evaluate = last or (t.eval_every and self.version % t.eval_every == 0)
            self._answer_pulls(
                (EVALUATE_AND_STOP if evaluate else STOP) if last else (EVALUATE_AND_RUN if evaluate else RUN)
            )
            if self.lead:
                # the servers' norm all-reduce is symmetric: each sent what the lead sent
                row = self._row(loss / self.workers, grad_norm, self.peers.take_step()[0] * self.servers)
                self._write({**row, **self._await_report()} if evaluate else row)
            if last or (ckpt.every and self.version % ckpt.every == 0):
                self._checkpoint()

    def _answer_pulls(self, status: int) -> None:
        for worker in self._workers():
            _, head = self.link.recv(worker)
            self.pending_traffic += head["traffic"]
            self._answer(worker, status, self.samples_seen)

    def _answer(self, worker: int, status: int, start: int) -> None:
        message = header(status=status, version=self.version, start=start)
        self.link.send(worker, message, flatten([p.detach() for p in self.owned]))

    def _step(self, grads: torch.Tensor, clip: float) -> float:
        """One optimizer step of the owned run; with `clip`, by the norm over every server's run."""
        for p, grad in zip(self.owned, unflatten(grads, self.owned), strict=True):
            p.grad = grad
        norm = 0.0
        if clip:
            squares = torch.nn.utils.get_total_norm([p.grad for p in self.owned]).float() ** 2
            if self.servers > 1:
                self.peers.all_reduce(squares, self.runtime.group)
            total = squares.sqrt()
            torch.nn.utils.clip_grads_with_norm_(self.owned, clip, total)
            norm = total.item()
        set_learning_rate(self.optimizer, learning_rate(self.version, self.config.train))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.samples_seen += self.update_batch
        return norm

    def _serve_async(self) -> None:
        steps = self.config.train.steps
        queue: collections.deque[int] = collections.deque()  # batches of dropped gradients, handed out first
        active, dropped, final_row = self.workers, 0, None
        while active:
            worker, head, order = self._next_message(queue)
            if head["kind"] == PUSH:
                grads = self.link.recv_payload(worker, self.owned)
                if order == DROP:
                    dropped += 1
                    continue
                staleness = self.version - int(head["version"])
                self._step(grads, clip=0.0)
                if self.lead:
                    row = self._row(head["loss"], head["grad_norm"], self.peers.take_step()[0])
                    tokens = self.per_push * self.config.model.block_size
                    row.update(
                        staleness=staleness,
                        worker=worker,
                        dropped=dropped,
                        worker_tokens_per_s=tokens / head["compute_s"],
                    )
                    dropped = 0
                    if self.version < steps:
                        self._write(row)
                    else:
                        final_row = row  # written with the final evaluation
                continue
            start = 0
            if order == RUN and self.lead:
                start = queue.popleft() if queue else self.next_sample
                if start == self.next_sample:
                    self.next_sample += self.per_push
            self._answer(worker, order, start)
            if order in (STOP, EVALUATE_AND_STOP):
                active -= 1
        if self.first_version < steps:  # else there was nothing to do
            if self.lead:  # with what the workers said after the last update
                final_row["comm_bytes"] += self.pending_traffic
                self._write({**final_row, **self._await_report()})
            self._checkpoint()

    def _next_message(self, queue: collections.deque[int]) -> tuple[int, dict[str, float], int]:
        """The next worker message to handle, and what to do with it: the lead decides, in arrival
        order, and tells the other servers, which handle the same messages in the same order."""
        if not self.lead:
            _, order = self.peer_link.recv(LEAD, ORDER_TAG)
            worker = int(order["peer"])
            return worker, self.link.recv(worker)[1], int(order["status"])
        steps = self.config.train.steps
        worker, head = self.link.recv(None)
        self.pending_traffic += head["traffic"]
        if head["kind"] == PUSH:
            fresh = self.version - int(head["version"]) <= self.config.sync.max_staleness
            order = APPLY if self.version < steps and fresh else DROP
            if self.version < steps and not fresh:
                queue.append(int(head["start"]))
        elif self.version < steps:
            order = RUN
        else:
            order = EVALUATE_AND_STOP if self.first_version < steps else STOP  # nothing done: no evaluation
        for server in range(1, self.servers):
            self.peer_link.send(server, header(status=order, peer=worker), tag=ORDER_TAG)
        return worker, head, order

    # --- metrics (lead server) ---------------------------------------------------------------------------

    def _open_log(self) -> MetricsLogger:
        run_dir, s, t = Path(self.config.run.dir), self.config.sync, self.config.train
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RESOLVED_CONFIG).write_text(self.config.to_toml())
        self.peak_flops = device_peak_flops(self.runtime.device, self.config.precision.dtype)
        self.flops_per_token = self.model.flops_per_token()
        logger = MetricsLogger(run_dir, self.config.log, self.version, t.steps)
        how = (
            f"asynchronous (max staleness {s.max_staleness}), {self.per_push} sequences per update"
            + ("; validation and checkpoints at the end only" if t.eval_every or self.config.checkpoint.every else "")
            if s.ps_async
            else f"synchronous, global batch {self.update_batch} = {self.workers} x {self.per_push} sequences"
        )
        logger.message(
            f"paralm: parameter server, {self.model.num_params() / 1e6:.2f}M parameters on {self.servers} "
            f"server(s), {self.workers} worker(s) on {self.runtime.device.type}, {how}; "
            f"{'resuming at step ' + str(self.version) if self.version else 'starting'} -> step {t.steps}"
        )
        return logger

    def _row(self, loss: float, grad_norm: float, server_traffic: float) -> dict[str, Any]:
        now = time.perf_counter()
        step_time, self.last_time = now - self.last_time, now
        tokens_per_s = self.update_batch * self.config.model.block_size / step_time
        traffic, self.pending_traffic = self.pending_traffic + server_traffic, 0.0
        return {
            "step": self.version - 1,
            "loss": loss,
            "lr": learning_rate(self.version - 1, self.config.train),
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / (self.peak_flops * self.runtime.world_size),
            "step_time_s": step_time,
            "samples_seen": self.samples_seen,
            "comm_bytes": traffic,
        }

    def _await_report(self) -> dict[str, float]:
        first_worker = self.servers
        _, head = self.link.recv(first_worker)
        if head["kind"] != REPORT:
            raise RuntimeError(f"parameter server: expected rank {first_worker}'s evaluation report")
        return {"val_loss": head["val_loss"], "traffic": head["traffic"] + len(FIELDS) * 8}  # and the report itself

    def _write(self, row: dict[str, Any]) -> None:
        row["comm_bytes"] = int(row.get("comm_bytes", 0) + row.pop("traffic", 0))
        self.logger.write(row)
        self.logger.progress(row)
