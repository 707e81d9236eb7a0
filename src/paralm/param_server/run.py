"""Every rank of a parameter-server job starts here: servers serve, workers compute (see the package)."""

from __future__ import annotations

import torch.distributed as dist

from paralm.config.rules import check_parameter_server
from paralm.config.schema import Config
from paralm.data.prepare import dataset_dir
from paralm.errors import UserError
from paralm.parallel.runtime import Runtime
from paralm.param_server.protocol import LEAD
from paralm.param_server.server import Server
from paralm.param_server.worker import Worker
from paralm.train.checkpoint.choose import checkpoint_to_resume
from paralm.train.checkpoint.init_from import init_checkpoint, init_source
from paralm.train.checkpoint.masked import saved_masks
from paralm.train.engine import StepEngine


def run_parameter_server(config: Config, runtime: Runtime) -> None:
    check_parameter_server(config, runtime.device.type)
    refuse_pruned(config)
    if runtime.local_rank == 0:  # a server here, which builds no step engine: it prepares the data for the workers'
        dataset_dir(config.data)
    # the lead server writes checkpoints alone (DCP's metadata on gloo); every rank takes part in creating it
    solo = dist.new_group([LEAD], backend="gloo")
    dist.barrier(group=runtime.host_group)
    if runtime.is_server:
        Server(config, runtime, solo).serve()
    else:
        Worker(StepEngine(config, runtime), config, runtime).work()


def refuse_pruned(config: Config) -> None:
    """The servers step the parameters and keep no pruning masks: a pruned run's weights would grow back, the
    run's own or those of the pruned run `checkpoint.init_from` starts it from."""
    resume_from = checkpoint_to_resume(config)
    checkpoint = resume_from or init_checkpoint(init_source(config, resume_from))
    if saved_masks(checkpoint):
        raise UserError(
            f"{checkpoint} is a pruned run: the parameter server does not keep pruning masks, so pruned "
            "weights would grow back; fine-tune it with sync.mode = 'allreduce' (DDP or FSDP keep them)"
        )
