"""What one parameter server holds: its slice of the parameters and their optimizer state.

The parameters are cut, in model order, into slices of about equal size; server s owns slice s, holds
optimizer state for it alone and is the only one to step it. The lead server also keeps a copy of
the others' slices, refreshed at checkpoints, and writes an ordinary checkpoint that any mode loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from paralm.config.schema import Config
from paralm.models.registry import model_spec
from paralm.parallel.comm_stats import CommStats
from paralm.parallel.runtime import Runtime
from paralm.param_server.protocol import LEAD, Endpoint, Tag, recv_object, send_object, shard_bounds
from paralm.sync.base import SyncStrategy, TrainingState
from paralm.sync.flat import unflatten
from paralm.train.checkpoint.choose import checkpoint_to_resume
from paralm.train.checkpoint.store import load_checkpoint, save_checkpoint, trainer_state
from paralm.train.optim.build import build_optimizer
from paralm.train.optim.schedule import learning_rate, set_learning_rate


class ServerShard:
    def __init__(
        self, config: Config, runtime: Runtime, peers: CommStats, solo: dist.ProcessGroup, device: torch.device
    ) -> None:
        self.config, self.runtime, self.peers, self.solo = config, runtime, peers, solo
        self.lead, self.servers, self.device = runtime.rank == LEAD, runtime.servers, device
        self.host = runtime.host_group  # optimizer state and checkpoint slices travel pickled, on gloo
        # the whole structure; only the owned slice is stepped
        self.model = model_spec(config.model).build(config.model).to(device)
        self.params = list(self.model.parameters())
        self.bounds = shard_bounds([p.numel() for p in self.params], self.servers)
        mine = self.bounds[runtime.rank]
        self.owned = self.params[mine.start : mine.stop]
        self.optimizer = build_optimizer(self.model, config.train)  # it keeps state only for what it steps
        if not self.lead:  # which is only the owned slice: drop the rest (the lead keeps it, to write checkpoints)
            for p in self.params[: mine.start] + self.params[mine.stop :]:
                p.data = p.data.new_empty(0)
        self.version = self.samples_seen = 0
        self.saved_batch: int | None = None  # the resumed checkpoint's global batch, if it records one

    @torch.no_grad()
    def receive_initial_state(self, link: Endpoint) -> None:
        """Parameters from the first worker; the lead restores a checkpoint and tells the others where it is."""
        first_worker = self.servers
        link.recv(first_worker, Tag.STATE)
        flat = link.recv_payload(first_worker, self.owned)
        for p, value in zip(self.owned, unflatten(flat, self.owned), strict=True):
            p.copy_(value)
        if self.lead:
            self._restore()
            for server in range(1, self.servers):
                state = {"version": self.version, "samples_seen": self.samples_seen, "global_batch": self.saved_batch}
                state["optim"] = self._slice_state(server)
                with self.peers.attributing():
                    send_object(state, server, Tag.STATE, self.host)
        else:
            with self.peers.attributing():
                state = recv_object(LEAD, Tag.STATE, self.host, self.device)
            self.version, self.samples_seen = state["version"], state["samples_seen"]
            self.saved_batch = state["global_batch"]
            self._set_state(state["optim"])
        self.peers.take_step()  # not synchronisation traffic: in the summary, not in a row

    def _checkpoint_state(self) -> TrainingState:
        return TrainingState(self.model, self.optimizer, SyncStrategy())

    def _restore(self) -> None:
        path = checkpoint_to_resume(self.config)
        if path is None:
            return
        state = load_checkpoint(path, self._checkpoint_state(), self.solo)
        self.version, self.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.saved_batch = state.get("global_batch")

    def _slice_state(self, server: int) -> dict[int, dict[str, Any]]:
        """Optimizer state of server `server`'s slice, by parameter index."""
        return {
            i: self.optimizer.state[self.params[i]]
            for i in self.bounds[server]
            if self.params[i] in self.optimizer.state
        }

    def _set_state(self, state: dict[int, dict[str, Any]]) -> None:
        for index, values in state.items():
            self.optimizer.state[self.params[index]] = values

    @torch.no_grad()
    def checkpoint(self, global_batch: int | None) -> str | None:
        """Collective over the servers: the others send their slices to the lead, which writes them all
        (with `global_batch`, the sequences of an update, when synchronous) and returns where."""
        if not self.lead:
            mine = {i: self.params[i].detach() for i in self.bounds[self.runtime.rank]}
            with self.peers.attributing():
                send_object({"params": mine, "optim": self._slice_state(self.runtime.rank)}, LEAD, Tag.STATE, self.host)
            self.peers.take_step()
            return None
        for server in range(1, self.servers):
            with self.peers.attributing():
                shard = recv_object(server, Tag.STATE, self.host, self.device)
            for index, value in shard["params"].items():
                self.params[index].copy_(value)
            self._set_state(shard["optim"])
        state = trainer_state(self.version, self.samples_seen, self.config.model.block_size, self.runtime.world_size)
        if global_batch is not None:  # a resume on another layout keeps it (`paralm.param_server.batch`)
            state["global_batch"] = global_batch
        alone = dataclasses.replace(self.runtime, group=self.solo)
        path = save_checkpoint(
            self.config.run.dir,
            self.version,
            self._checkpoint_state(),
            state,
            self.config,
            alone,
            keep=self.config.checkpoint.keep,
        )
        return str(path)

    def step(self, grads: torch.Tensor, clip: float, update_batch: int) -> float:
        """One optimizer step of the owned slice; with `clip`, by the norm over every server's slice."""
        for p, grad in zip(self.owned, unflatten(grads, self.owned), strict=True):
            p.grad = grad
        norm = 0.0
        if clip:
            # on the servers' device group, wherever the slices are held
            squares = (torch.nn.utils.get_total_norm([p.grad for p in self.owned]).float() ** 2).to(self.runtime.device)
            if self.servers > 1:
                with self.peers.attributing():
                    dist.all_reduce(squares, group=self.runtime.group)
            total = squares.sqrt().to(self.device)
            torch.nn.utils.clip_grads_with_norm_(self.owned, clip, total)
            norm = total.item()
        set_learning_rate(self.optimizer, learning_rate(self.version, self.config.train))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.samples_seen += update_batch
        return norm
