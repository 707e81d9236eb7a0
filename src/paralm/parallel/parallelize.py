"""Apply the configured parallel strategies to a plain GPT, from outside, in a fixed order.

Order (as torchtitan): pipeline split, then tensor/sequence parallel, then activation
checkpointing, then data parallelism (FSDP or DDP) on what each rank holds. Each strategy lives in
its own module; this function only composes them.
"""

from __future__ import annotations

from torch import nn

from paralm.config import Config
from paralm.parallel.ddp import apply_ddp
from paralm.parallel.runtime import Runtime


def parallelize(model: nn.Module, runtime: Runtime, config: Config) -> nn.Module:
    """The module the training step calls; parameters stay those of `model` (possibly sharded)."""
    if runtime.dims.dp > 1:
        return apply_ddp(model, runtime, config.comm.bucket_mb)
    return model
