"""Parameter server: ranks 0..k-1 (`sync.ps_servers` = k) hold the parameters and optimizer state,
sharded (`ps_shard`); the other ranks are workers (`ps_worker`) that pull parameters, compute
gradients with the trainer's step engine and push them.

It runs on `torch.distributed` point-to-point messages (`paralm.parallel.ps_protocol`), launched by
torchrun like every other mode. The servers run their own loop (`ps_server`): the optimizer steps
there, not on the workers. Evaluation runs on the workers (at `train.eval_every` and the end when
synchronous, at the end when not: asynchronous workers hold different parameters until then).

A rank that dies closes its connections, so its peers' sends and receives fail at once and torchrun
stops the job; the launcher names the rank that failed first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from paralm.config import Config
from paralm.data.prepare import dataset_dir
from paralm.parallel.ps_protocol import LEAD
from paralm.parallel.runtime import Runtime
from paralm.rules import check_parameter_server
from paralm.train.ps_server import Server
from paralm.train.ps_worker import Worker

if TYPE_CHECKING:
    from collections.abc import Callable

    from paralm.train.trainer import Trainer


def run_parameter_server(config: Config, runtime: Runtime, trainer: Callable[[Config, Runtime], Trainer]) -> None:
    """Every rank of a parameter-server job: servers serve, workers compute with `trainer(config, runtime)`."""
    check_parameter_server(config, runtime.device.type)
    if runtime.local_rank == 0:  # a server here, which builds no Trainer: it prepares the data for the workers'
        dataset_dir(config.data)
    # the lead server writes checkpoints alone (DCP's metadata on gloo); every rank takes part in creating it
    solo = dist.new_group([LEAD], backend="gloo")
    dist.barrier(group=runtime.host_group)
    if runtime.is_server:
        Server(config, runtime, solo).serve()
    else:
        Worker(trainer(config, runtime), config, runtime).work()
