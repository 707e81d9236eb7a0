"""The process's place in the job: rank, device, process group and device mesh.

One process (no launcher) runs without a process group; under `torchrun` or `paralm train --nproc`
the environment says rank and world size, and the backend follows the device: NCCL on GPUs (with gloo
for the CPU tensors of CPU offload), gloo on CPUs.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paralm.compat import flatten_mesh, init_fake_process_group
from paralm.config.dims import MESH_DIMS, ParallelDims
from paralm.config.schema import ParallelConfig, SyncConfig
from paralm.errors import UserError
from paralm.parallel.comm_stats import CommStats


@dataclass
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    dims: ParallelDims
    mesh: DeviceMesh | None  # None for a single process
    dp_mesh: DeviceMesh | None  # dp_replicate x dp_shard flattened: the ranks that see different data
    servers: int = 0  # parameter-server ranks (the first ones): outside the mesh, they run no model
    group: dist.ProcessGroup | None = None  # the ranks that step together: all (None), the workers, or the servers
    comm: CommStats = field(default_factory=CommStats)  # bytes this rank hands to torch.distributed
    # gloo groups for host metadata (headers, counters, flags), which NCCL cannot carry: every rank, and
    # the ranks that step together (`group`'s ranks); None for a single process
    host_group: dist.ProcessGroup | None = None
    host_step_group: dist.ProcessGroup | None = None
    # dp_replicate x dp_shard x cp flattened: the ranks whose gradients average (`dp_mesh` without cp)
    grad_mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_server(self) -> bool:
        return self.rank < self.servers

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.dims.forced

    def counting(self, on: bool) -> contextlib.AbstractContextManager:
        """Count this rank's collectives (`CommStats.counting`) when asked (`log.comm_bytes`) and there are
        any (one process issues none): a dispatch mode that sees every operator, in Python (12-18% of a
        small model's step on a CPU), so nothing is entered otherwise."""
        return self.comm.counting() if on and self.distributed else contextlib.nullcontext()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None

    @property
    def grad_group(self) -> dist.ProcessGroup | None:
        return self.grad_mesh.get_group() if self.grad_mesh is not None else None

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce over the ranks that step together; a no-op for a single process."""
        if self.distributed:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def host_all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """`all_reduce` of a CPU tensor over the ranks that step together, on their gloo group."""
        if self.distributed:
            dist.all_reduce(tensor, op=op, group=self.host_step_group)
        return tensor

    def reduce_metrics(self, table: torch.Tensor, num_sums: int) -> torch.Tensor:
        """Rows of metrics (steps x values, this rank's, on its device): the first `num_sums` columns
        added up over the ranks that step together, the others maximised, in one collective (an
        all-gather of the table). Nothing here waits for the device."""
        if self.distributed:
            gathered = [torch.empty_like(table) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(gathered, table, group=self.group)
            stacked = torch.stack(gathered)
            return torch.cat([stacked[..., :num_sums].sum(0), stacked[..., num_sums:].amax(0)], dim=-1)
        return table

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


def select_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# the backend of each device's tensors in the default group (and the mesh groups, which inherit it)
DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def process_group_backend(device: torch.device) -> str:
    """gloo on CPUs; on an accelerator its backend for its tensors and gloo for CPU ones, which FSDP's
    CPU offload reduces over the same groups (the gradient norm at clipping), as torchtitan does."""
    if device.type == "cpu":
        return DEVICE_BACKENDS["cpu"]
    return f"{device.type}:{DEVICE_BACKENDS[device.type]},cpu:{DEVICE_BACKENDS['cpu']}"


def init_runtime(parallel: ParallelConfig, sync: SyncConfig) -> Runtime:
    """Join the job the launcher set up (if any) and build the mesh for the configured degrees.

    A collective waits `parallel.timeout_s` for a hung or dead peer, then raises (the launcher names the rank).

    With `sync.servers` parameter-server ranks, those are ranks 0..servers-1 and the mesh holds the others.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    timeout = timedelta(seconds=parallel.timeout_s)
    dims = ParallelDims.from_config(parallel, sync, world_size)
    servers = sync.servers
    device = select_device(local_rank)
    mesh = dp_mesh = grad_mesh = group = host = host_step = None
    if dims.forced and "MASTER_ADDR" not in os.environ:
        raise UserError("parallel.force_distributed = true needs a launcher: run under torchrun --nproc-per-node 1")
    if world_size > 1 or dims.forced:
        dist.init_process_group(
            process_group_backend(device),
            store=_restart_safe_store(rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        mesh, dp_mesh, grad_mesh = _meshes(device.type, dims, servers, world_size)
        if servers:  # every rank takes part in creating every group
            server_group = dist.new_group(list(range(servers)))
            group = server_group if rank < servers else dp_mesh.get_group()
            if rank < servers:
                mesh = dp_mesh = grad_mesh = None
        host, host_step = _host_groups(rank, world_size, servers)
    return Runtime(
        rank,
        local_rank,
        world_size,
        device,
        dims,
        mesh,
        dp_mesh,
        servers,
        group,
        host_group=host,
        host_step_group=host_step,
        grad_mesh=grad_mesh,
    )


def rehearsal_runtime(
    parallel: ParallelConfig, sync: SyncConfig, rank: int, world_size: int, device: torch.device | None = None
) -> Runtime:
    """Rank `rank` of a `world_size`-rank job in this one process, for a dry run: a fake process group
    (no peers, every collective a no-op) and the meta device, so the real strategies shard a model that
    never allocates memory. No host groups: nothing here talks to a peer. With a real `device` the rank's
    shards are allocated there and its compute runs (`paralm plan --measure` times it)."""
    dims = ParallelDims.from_config(parallel, sync, world_size)
    if sync.servers:
        raise UserError("a dry run rehearses the trainer's mesh: sync.ps_servers has no place in it")
    device = device or torch.device("meta")
    init_fake_process_group(rank, world_size)
    mesh, dp_mesh, grad_mesh = _meshes("cpu" if device.type == "meta" else device.type, dims, 0, world_size)
    return Runtime(rank, rank, world_size, device, dims, mesh, dp_mesh, grad_mesh=grad_mesh)


def _meshes(device_type: str, dims: ParallelDims, servers: int, world_size: int) -> tuple[DeviceMesh, ...]:
    """The mesh of the degrees (over the ranks after the servers), its data-parallel dims flattened, and
    those with cp (the ranks whose gradients average)."""
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if servers:
        mesh = DeviceMesh(device_type, torch.arange(servers, world_size).view(shape), mesh_dim_names=MESH_DIMS)
    else:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    dp_mesh = flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
    grad_mesh = flatten_mesh(mesh["dp_replicate", "dp_shard", "cp"], "dp_cp") if dims.cp_enabled else dp_mesh
    return mesh, dp_mesh, grad_mesh


def _host_groups(rank: int, world_size: int, servers: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """gloo groups for host metadata: all ranks, and this rank's side (servers or workers) when a
    parameter server splits the job. Every rank takes part in creating every group, in one order."""
    host = dist.new_group(backend="gloo")
    if not servers:
        return host, host
    sides = [dist.new_group(list(r), backend="gloo") for r in (range(servers), range(servers, world_size))]
    return host, sides[rank >= servers]


def _restart_safe_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The launcher's TCP store, with keys prefixed by the restart attempt.

    After an elastic restart the store still holds the previous attempt's keys, and a plain
    `init_process_group` can read them and hang or fail (seen with gloo); a fresh prefix per attempt
    starts every rendezvous clean.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
    )
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown(runtime: Runtime, together: bool = True) -> None:
    """Leave the job: with a barrier first when every rank is leaving (or a fast rank's exit can abort a
    slower one), without one after a failure (peers may be stuck elsewhere). Either way the groups are
    destroyed before the interpreter exits, so no communication thread outlives them."""
    if runtime.distributed and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()
