"""A parameter server's loop: answer pulls with its slice of the parameters, apply pushed gradients.

Synchronous (`sync.ps_async = false`): a step waits for every worker's gradient; the servers average
them as DDP's all-reduce does (divide by the workers, sum in rank order), clip by the norm of the
whole averaged gradient (servers add up their squared slice norms) and step: the same training as
all-reduce data parallelism over the workers.

Asynchronous: the lead server takes messages in arrival order and forwards that order to the other
servers, so every slice sees the same sequence of updates. A gradient computed on parameters `s`
updates old (its staleness) is applied as soon as it arrives if s <= `sync.max_staleness`; otherwise
it is dropped, its batch is queued for the next pull, and the worker that fell that far behind
restarts from fresh parameters: it waits, the others never do. A step is one update, of one worker's
batch.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from paralm.config.schema import Config
from paralm.parallel.comm_stats import CommStats
from paralm.parallel.runtime import Runtime
from paralm.param_server.batch import update_layout
from paralm.param_server.log import ServerLog
from paralm.param_server.protocol import LEAD, Endpoint, Header, Kind, Status, Tag
from paralm.param_server.shard import ServerShard
from paralm.sync.flat import flatten


class Server:
    def __init__(self, config: Config, runtime: Runtime, solo: dist.ProcessGroup) -> None:
        self.config, self.runtime = config, runtime
        self.lead = runtime.rank == LEAD
        self.link = Endpoint.between(runtime.comm, config.sync, runtime.device, runtime.host_group)
        self.peers = CommStats()  # server-to-server bytes, kept apart: the workers report all others
        self.peer_link = Endpoint.between(self.peers, config.sync, runtime.device, runtime.host_group)
        self.servers, self.workers = runtime.servers, runtime.dims.dp
        self.shard = ServerShard(config, runtime, self.peers, solo, self.link.device)
        self.shard.receive_initial_state(self.link)
        # the workers lay out the same batch: from the config and the checkpoint's global batch
        layout, note = update_layout(config, self.workers, self.shard.saved_batch)
        self.per_push = layout.grad_accum * layout.micro_batch_size  # one worker's sequences per update
        self.update_batch = layout.global_batch
        self.first_version = self.shard.version
        self.next_sample = self.shard.samples_seen  # asynchronous: the next batch to hand out
        self.log = ServerLog(config, runtime, self.shard, self.link, layout) if self.lead else None
        if self.log and note:
            self.log.message(f"paralm: {note}")

    def serve(self) -> None:
        if self.log and self.shard.version >= self.config.train.steps:
            self.log.message(f"nothing to do: the checkpoint is at step {self.shard.version}")
        (self._serve_async if self.config.sync.ps_async else self._serve_sync)()
        line = None
        if self.config.log.comm_bytes:
            self.runtime.comm.sent += self.peers.sent
            self.runtime.comm.received += self.peers.received
            steps = self.shard.version - self.first_version
            run_dir = self.log.run_dir if self.log else None
            line = self.runtime.comm.summarise(self.runtime.world_size, steps, run_dir, self.runtime.device)
        if self.log:
            self.log.close(line)

    def _workers(self) -> range:
        return range(self.servers, self.runtime.world_size)

    def _checkpoint(self) -> None:
        path = self.shard.checkpoint(None if self.config.sync.ps_async else self.update_batch)
        if self.log:
            self.log.message(f"saved {path}")

    def _serve_sync(self) -> None:
        t, ckpt, shard = self.config.train, self.config.checkpoint, self.shard
        self._answer_pulls(Status.RUN if shard.version < t.steps else Status.STOP)
        while shard.version < t.steps:
            grads = torch.zeros(
                sum(p.numel() for p in shard.owned), dtype=shard.owned[0].dtype, device=self.link.device
            )
            loss = 0.0
            for worker in self._workers():  # in rank order, like the all-reduce's sum
                _, head = self.link.recv(worker)
                grads.add_(self.link.recv_payload(worker, shard.owned).div_(self.workers))
                loss += head.loss
                self._add_traffic(head)
            grad_norm = shard.step(grads, t.grad_clip, self.update_batch)
            last = shard.version == t.steps
            evaluate = last or bool(t.eval_every and shard.version % t.eval_every == 0)
            statuses = {(False, False): Status.RUN, (False, True): Status.EVALUATE_AND_RUN}
            statuses |= {(True, False): Status.STOP, (True, True): Status.EVALUATE_AND_STOP}
            self._answer_pulls(statuses[last, evaluate])
            if self.log:
                # the servers' norm all-reduce is symmetric: each sent what the lead sent
                row = self.log.row(loss / self.workers, grad_norm, self.peers.take_step()[0] * self.servers)
                self.log.write({**row, **self.log.await_report()} if evaluate else row)
            if last or (ckpt.every and shard.version % ckpt.every == 0):
                self._checkpoint()

    def _add_traffic(self, head: Header) -> None:
        if self.log:
            self.log.pending_traffic += head.traffic
            self.log.worker_peak_mem = max(self.log.worker_peak_mem, int(head.peak_mem))
            for key in self.log.worker_states:
                self.log.worker_states[key] = max(self.log.worker_states[key], int(getattr(head, key)))

    def _answer_pulls(self, status: Status) -> None:
        for worker in self._workers():
            _, head = self.link.recv(worker)
            self._add_traffic(head)
            self._answer(worker, status, self.shard.samples_seen)

    def _answer(self, worker: int, status: Status, start: int) -> None:
        message = Header(status=status, version=self.shard.version, start=start)
        self.link.send(worker, message, flatten([p.detach() for p in self.shard.owned]))

    def _serve_async(self) -> None:
        steps, shard = self.config.train.steps, self.shard
        queue: collections.deque[int] = collections.deque()  # batches of dropped gradients, handed out first
        active, dropped, final_row = self.workers, 0, None
        while active:
            worker, head, order = self._next_message(queue)
            if head.kind == Kind.PUSH:
                grads = self.link.recv_payload(worker, shard.owned)
                if order == Status.DROP:
                    dropped += 1
                    continue
                staleness = shard.version - head.version
                shard.step(grads, 0.0, self.update_batch)
                if self.log:
                    row = self.log.row(head.loss, head.grad_norm, self.peers.take_step()[0])
                    tokens = self.per_push * self.config.model.block_size
                    row.update(
                        staleness=staleness,
                        worker=worker,
                        dropped=dropped,
                        worker_tokens_per_s=tokens / head.compute_s,
                    )
                    dropped = 0
                    if shard.version < steps:
                        self.log.write(row)
                    else:
                        final_row = row  # written with the final evaluation
                continue
            start = 0
            if order == Status.RUN and self.lead:
                start = queue.popleft() if queue else self.next_sample
                if start == self.next_sample:
                    self.next_sample += self.per_push
            self._answer(worker, order, start)
            if order.stops:
                active -= 1
        if self.first_version < steps:  # else there was nothing to do
            if self.log:  # with what the workers said after the last update
                self.log.write({**final_row, **self.log.await_report()})
            self._checkpoint()

    def _next_message(self, queue: collections.deque[int]) -> tuple[int, Header, Status]:
        """The next worker message to handle, and what to do with it: the lead decides, in arrival
        order, and tells the other servers, which handle the same messages in the same order."""
        if not self.lead:
            _, order = self.peer_link.recv(LEAD, Tag.ORDER)
            return order.peer, self.link.recv(order.peer)[1], order.status
        steps, version = self.config.train.steps, self.shard.version
        worker, head = self.link.recv(None)
        self._add_traffic(head)
        if head.kind == Kind.PUSH:
            fresh = version - head.version <= self.config.sync.max_staleness
            order = Status.APPLY if version < steps and fresh else Status.DROP
            if version < steps and not fresh:
                queue.append(head.start)
        elif version < steps:
            order = Status.RUN
        else:  # nothing done: no evaluation
            order = Status.EVALUATE_AND_STOP if self.first_version < steps else Status.STOP
        for server in range(1, self.servers):
            self.peer_link.send(server, Header(status=order, peer=worker), tag=Tag.ORDER)
        return worker, head, order
