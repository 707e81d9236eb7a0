"""Which strategies MoE models and expert parallelism compose with: decided by the config alone."""

from __future__ import annotations

from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.models.moe_config import moe_options


def check_moe_layout(config: Config) -> None:
    """One-line errors for MoE models and expert parallelism under strategies they do not compose with
    (the config alone decides these)."""
    p, moe = config.parallel, moe_options(config.model)
    if p.ep < 1:
        raise UserError(f"parallel.ep = {p.ep} must be at least 1")
    if p.ep > 1 and moe is None:
        raise UserError("parallel.ep > 1 needs experts: set model.moe_experts (or parallel.ep = 1)")
    if moe is None:
        return
    if moe.experts % p.ep:
        raise UserError(f"model.moe_experts = {moe.experts} is not divisible by parallel.ep = {p.ep}")
    refused = {
        # each cp rank would cap its own share of the positions, where one process caps the micro-batch's
        "parallel.cp > 1 with model.moe_capacity > 0": p.cp > 1 and moe.capacity > 0,
        # the expert mesh cuts dp_shard into ep groups; the cp ranks are not in it
        "parallel.cp > 1 with parallel.ep > 1": p.cp > 1 and p.ep > 1,
        "sync.fault_tolerant": config.sync.fault_tolerant,
        # experts are weight tensors, not the linear layers torchao swaps (`paralm.convert.layers`)
        f"train.qat = {config.train.qat!r}": config.train.qat != "none",
        "precision.float8": config.precision.float8,
        # the MoE blocks' recomputation context is no dispatch mode, which torch.compile requires
        "train.compile with activation checkpointing": config.train.compile != "off"
        and config.train.activation_checkpointing != "none",
        # its servers step the parameters: the loss-free bias and the routing metrics would never move
        "sync.mode = 'parameter_server'": config.sync.mode == "parameter_server",
        "parallel.zero = 1 with parallel.ep > 1": p.zero == 1 and p.ep > 1,
        # a pipeline's (or TP's) data parallelism without ZeRO-2/3 is `replicate`, which would average the experts too
        "parallel.pp > 1 with parallel.ep > 1 without parallel.zero = 2 or 3": p.pp > 1 and p.ep > 1 and p.zero < 2,
        "parallel.tp > 1 with parallel.ep > 1 without parallel.zero = 2 or 3": p.tp > 1 and p.ep > 1 and p.zero < 2,
        f"sync.mode = {config.sync.mode!r} with parallel.ep > 1": config.sync.mode != "allreduce" and p.ep > 1,
    }
    for name, on in refused.items():
        if on:
            raise UserError(f"{name} is not supported with model.moe_experts > 0: turn it off or use a dense model")
