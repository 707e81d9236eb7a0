"""Replica groups that survive a peer's loss, on torchft.

Each replica group is a job of its own (one process, or torchrun's ranks with any layout inside), and
every group reads its own share of each step's batch. torchft's lighthouse forms a quorum of the
groups alive at each step; its `Manager` averages gradients across them after backward, over a process
group it rebuilds for each quorum, and commits the step only where every rank of the group succeeded.
A group that fails drops out of the next quorum while the others step on; a group that (re)starts
behind them heals: a healthy peer sends it the model, the optimizer and the loop's position, and it
takes part again from the next step. Quorum, healing and the reconfigurable groups are torchft's; this
module is the glue to paralm's loop and state.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from paralm import compat
from paralm.config.schema import SyncConfig
from paralm.errors import UserError
from paralm.parallel.runtime import Runtime
from paralm.sync.base import FLAT, SyncStrategy

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class ReplicaGroups(SyncStrategy):
    """Gradients averaged over the groups of each step's quorum; a step commits where the quorum agrees."""

    def __init__(self, model: nn.Module, runtime: Runtime, sync: SyncConfig) -> None:
        lighthouse = sync.ft_lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise UserError(
                f"sync.fault_tolerant = true needs a torchft lighthouse: start the groups with `paralm train "
                f"--replicas R`, or set sync.ft_lighthouse (or ${LIGHTHOUSE_ENV}) to a running one's address"
            )
        self.model, self.runtime = model, runtime
        self.optimizer: torch.optim.Optimizer | None = None
        self.position = (0, 0)  # the loop's (step, samples seen): a healing group takes its peer's
        self.joined = False
        self.store, address, port = _group_store(runtime, sync.ft_bind)  # kept: the group's manager lives on it
        with compat.torchft_manager_bound_to(sync.ft_bind):
            self.manager = _manager(runtime, sync, lighthouse, (address, port))

    def prepare(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.optimizer = optimizer
        self.manager.register_state_dict_fn("paralm", self._load, self._save)
        return optimizer

    def start_step(self, step: int, samples_seen: int) -> tuple[int, int]:
        """Join this step's quorum; a group behind the others heals from a peer and goes on from its position."""
        if not self.joined:  # the checkpoint the loop resumed from sets where this group stands
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
            self.joined = True
        self.position = (step, samples_seen)
        self.manager.start_quorum()
        return self.position

    def after_backward(self) -> bool:
        """Average this rank's gradients (its shards, under FSDP or TP) with the same rank of every other
        group, in one flat all-reduce per dtype; the step stands if every group of the quorum finished it
        (if not, nobody steps and the step runs again)."""
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            self.manager.allreduce(flat).wait()
            for g, averaged in zip(same, flat.split([g.numel() for g in same]), strict=True):
                g.copy_(averaged.view_as(g))
        return self.manager.should_commit()

    def step_metrics(self) -> dict[str, Any]:
        return {"replica_groups": self.manager.num_participants()}  # the groups this step's gradients averaged

    def _save(self) -> dict[str, Any]:
        """What a healing peer needs: this rank's model and optimizer state (local shards) and the position."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=FLAT)
        step, samples_seen = self.position
        return {"model": _locals(model_state), "optim": _locals(optim_state), "step": step, "samples": samples_seen}

    def _load(self, state: dict[str, Any]) -> None:
        """A peer's state, placed like this rank's own (groups share one layout, so the shards match)."""
        model_target, optim_target = get_state_dict(self.model, self.optimizer, options=FLAT)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=_placed(state["model"], model_target),
            optim_state_dict=_placed(state["optim"], optim_target),
            options=FLAT,
        )
        self.position = (state["step"], state["samples"])


def _manager(runtime: Runtime, sync: SyncConfig, lighthouse: str, store: tuple[str, int]) -> Any:
    """This group's torchft manager, on the group's store; with `sync.ft_bind`, its servers listen there alone."""
    from torchft import Manager

    timeout = timedelta(seconds=sync.ft_timeout_s)
    return Manager(
        pg=_cross_group(runtime.device, timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=sync.ft_min_groups,
        use_async_quorum=False,  # heal before the step's forward, so the loop goes on from the peer's position
        timeout=timeout,
        # a peer can spend `timeout` failing a collective (or connecting to a group that lost a member) before
        # it asks for the next quorum: a group waiting only as long gives up just as that peer arrives
        quorum_timeout=2 * timeout,
        connect_timeout=timeout,
        rank=runtime.rank,
        world_size=runtime.world_size,
        store_addr=store[0],
        store_port=store[1],
        lighthouse_addr=lighthouse,
        replica_id=f"paralm_group_{sync.ft_group}",
        checkpoint_transport=compat.weights_only_http_transport(timeout, sync.ft_bind),
        **({"hostname": sync.ft_bind} if sync.ft_bind else {}),  # the address peers are told
        init_sync=False,  # every group initialises the same weights from the seed
    )


def _group_store(runtime: Runtime, bind: str) -> tuple[dist.TCPStore | None, str, int]:
    """A TCP store for the group's manager, hosted by the group's rank 0 (a one-process group has no
    launcher's store); its port reaches the other ranks on the host group. With `bind` (`sync.ft_bind`) it
    listens there alone, as the manager's servers do."""
    address = bind or os.environ.get("MASTER_ADDR", "127.0.0.1")
    store, port = None, torch.zeros(1, dtype=torch.int64)
    if runtime.rank == 0:
        store = _store_on(bind) if bind else dist.TCPStore(address, 0, is_master=True, wait_for_workers=False)
        port[0] = store.port
    if runtime.distributed:
        dist.broadcast(port, src=0, group=runtime.host_group)
    return store, address, int(port[0])


def _store_on(host: str) -> dist.TCPStore:
    """A store listening on `host` alone: TCPStore binds every interface unless handed a listening socket."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
    except OSError as e:
        listener.close()
        raise UserError(f"sync.ft_bind = {host}: cannot listen there ({e}); use an address of this machine") from None
    listener.listen()
    port = listener.getsockname()[1]  # the store owns the socket from here
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach())


def _cross_group(device: torch.device, timeout: timedelta) -> Any:
    """torchft's reconfigurable process group for the device: NCCL on GPUs, gloo on CPUs."""
    import torchft

    if device.type == "cuda":
        return torchft.ProcessGroupNCCL(timeout=timeout)
    return torchft.ProcessGroupGloo(timeout=timeout)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _locals(state: dict[str, Any]) -> dict[str, Any]:
    return {k: _local(v).detach() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _placed(received: dict[str, Any], targets: dict[str, Any]) -> dict[str, Any]:
    placed = {}
    for key, value in received.items():
        target = targets.get(key)
        if isinstance(target, DTensor):
            value = DTensor.from_local(
                value.to(target.device),
                target.device_mesh,
                target.placements,
                shape=target.shape,
                stride=target.stride(),
            )
        elif isinstance(target, torch.Tensor):
            value = value.to(target.device)
        placed[key] = value
    return placed
