"""A parameter-server worker: pulls parameters, computes gradients on the step engine the trainer
also runs (its data, micro-batches and forward/backward), pushes them, and evaluates when told to."""

from __future__ import annotations

import time

import torch

from paralm.config.schema import Config
from paralm.parallel.runtime import Runtime
from paralm.param_server.batch import update_layout
from paralm.param_server.protocol import LEAD, Endpoint, Header, Kind, Tag, shard_bounds
from paralm.sync.flat import flatten, unflatten
from paralm.train.engine import StepEngine
from paralm.train.memory import local_bytes
from paralm.train.metrics import peak_memory_bytes


class Worker:
    def __init__(self, engine: StepEngine, config: Config, runtime: Runtime) -> None:
        self.engine, self.config, self.runtime = engine, config, runtime
        self.link = Endpoint.between(runtime.comm, config.sync, runtime.device, runtime.host_group)
        self.params = list(engine.model.parameters())
        bounds = shard_bounds([p.numel() for p in self.params], runtime.servers)
        self.shards = [self.params[b.start : b.stop] for b in bounds]
        # the checkpoint's weights (the lead server restores the optimizer) and global batch
        state = engine.resume(engine.module) or {}
        # asynchronous: an update is one worker's batch; synchronous: the global batch, each worker
        # taking its slice as in all-reduce data parallelism (the lead server decides the same layout)
        engine.layout, _ = update_layout(config, runtime.dims.dp, state.get("global_batch"))
        if config.sync.ps_async:
            engine.dp_rank = 0
        self.first = runtime.rank == runtime.servers

    def work(self) -> None:
        self._work()
        if self.config.log.comm_bytes:  # collective: the lead server writes it
            self.runtime.comm.summarise(self.runtime.world_size, 0, None, self.runtime.device)

    def _work(self) -> None:
        if self.first:  # the servers start from this worker's parameters (initialised, or restored)
            for server, shard in enumerate(self.shards):
                self.link.send(server, Header(), flatten([p.detach() for p in shard]), Tag.STATE)
        reply = self.pull()
        while True:
            if reply.status.evaluates:
                unreported = self._traffic()  # with the servers, before the evaluation's collectives
                self.report(self.engine.evaluate()["val_loss"], unreported)
            if reply.status.stops:
                return
            self.push(*self.compute(reply.version, reply.start), reply)
            reply = self.pull()

    def compute(self, version: int, start: int) -> tuple[float, float, float]:
        """Gradients of this worker's batch at `start`: (loss, grad norm (async only), seconds)."""
        started = time.perf_counter()
        self.engine.plan.before_step(self.config.train.seed, version)
        loss = self.engine.forward_backward(self.engine.step_batch(start)).item()
        grad_norm = 0.0
        if self.config.sync.ps_async:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.train.grad_clip or float("inf")).item()
        return loss, grad_norm, time.perf_counter() - started

    def _traffic(self) -> int:
        """Bytes this worker sent and received since it last told the lead server."""
        return sum(self.runtime.comm.take_step())

    def push(self, loss: float, grad_norm: float, seconds: float, reply: Header) -> None:
        states = {"param_bytes": local_bytes(self.params), "grad_bytes": local_bytes(p.grad for p in self.params)}
        for server, shard in enumerate(self.shards):
            message = Header(
                kind=Kind.PUSH,
                version=reply.version,
                start=reply.start,
                loss=loss,
                grad_norm=grad_norm,
                compute_s=seconds,
                peak_mem=peak_memory_bytes(self.runtime.device),
                **states,
                traffic=self._traffic() if server == LEAD else 0,
            )
            self.link.send(server, message, flatten([p.grad for p in shard]))
        self.engine.model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def pull(self) -> Header:
        """Fresh parameters from every server; returns the lead's answer (what to do next)."""
        for server in range(len(self.shards)):
            self.link.send(server, Header(kind=Kind.PULL, traffic=self._traffic() if server == LEAD else 0))
        answers = []
        for server, shard in enumerate(self.shards):
            answers.append(self.link.recv(server)[1])
            flat = self.link.recv_payload(server, shard)
            for p, value in zip(shard, unflatten(flat, shard), strict=True):
                p.copy_(value)
        return answers[LEAD]

    def report(self, val_loss: float, unreported: int) -> None:
        """After an evaluation (collective over the workers) the first worker sends the loss to the lead
        server, with all workers' traffic with the servers not yet reported. The evaluation's and this
        sum's collectives are between workers, not an update's: counted apart (`other_bytes`). Without
        counting (`log.comm_bytes`) there is nothing to sum."""
        traffic = 0.0
        if self.config.log.comm_bytes:
            traffic = self.runtime.host_all_reduce(torch.tensor([float(unreported)], dtype=torch.float64)).item()
            self.runtime.comm.set_aside()
        if self.first:
            self.link.send(LEAD, Header(kind=Kind.REPORT, val_loss=val_loss, traffic=traffic))
