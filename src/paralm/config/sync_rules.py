"""The rules for how replicas synchronise: sync modes, gradient compression and fault-tolerant replica
groups, which combinations exist and their ranges. Part of `paralm.config.rules.validate`."""

from __future__ import annotations

from paralm.config.schema import Config
from paralm.errors import UserError


def check_compression(config: Config) -> None:
    """QAT and FP8 swap the blocks' linear layers; the swapped layers are not tensor-parallel here."""
    for name, on in (("train.qat", config.train.qat != "none"), ("precision.float8", config.precision.float8)):
        if on and config.parallel.tp > 1:
            raise UserError(
                f"{name} with parallel.tp = {config.parallel.tp}: paralm runs it without tensor parallelism; "
                "set parallel.tp = 1"
            )


def validate_sync(config: Config) -> None:
    """Replica synchronisation and gradient compression: ranges, and which combinations exist."""
    s, c = config.sync, config.comm
    at_least = {
        "sync.ps_servers": (s.ps_servers, 1),
        "sync.local_steps": (s.local_steps, 1),
        "sync.max_staleness": (s.max_staleness, 0),
        "comm.powersgd_rank": (c.powersgd_rank, 1),
        "comm.powersgd_start_step": (c.powersgd_start_step, 2),
        "sync.outer_lr": (s.outer_lr, 0),
        "sync.outer_momentum": (s.outer_momentum, 0),
        "sync.straggler_delay_s": (s.straggler_delay_s, 0),
        "sync.ft_groups": (s.ft_groups, 1),
        "sync.ft_min_groups": (s.ft_min_groups, 1),
        "sync.ft_group": (s.ft_group, 0),
    }
    for name, (value, low) in at_least.items():
        if value < low:
            raise UserError(f"{name} = {value} must be at least {low}")
    if not 0 < c.topk_ratio <= 1:
        raise UserError(f"comm.topk_ratio = {c.topk_ratio} must be in (0, 1]")
    if s.outer_momentum >= 1:
        raise UserError(f"sync.outer_momentum = {s.outer_momentum} must be below 1")
    if c.compression != "none" and s.mode != "allreduce":
        raise UserError(
            f"comm.compression = {c.compression} compresses all-reduce gradients: it needs sync.mode = allreduce, "
            f"not {s.mode}"
        )
    p = config.parallel
    if (c.compression != "none" or s.mode != "allreduce") and (p.zero, p.tp, p.pp, p.cp) != (0, 1, 1, 1):
        what = f"sync.mode = {s.mode}" if s.mode != "allreduce" else f"comm.compression = {c.compression}"
        raise UserError(
            f"{what} replicates whole models: set parallel.zero = 0, parallel.tp = 1, parallel.pp = 1, parallel.cp = 1"
        )
    if s.mode == "parameter_server" and config.precision.dtype == "fp16":
        raise UserError(
            "precision.dtype = fp16 needs a loss scale the parameter server does not keep: "
            "use precision.dtype = bf16 or fp32 with sync.mode = parameter_server"
        )
    if s.fault_tolerant:
        check_fault_tolerant(config)
    check_muon(config)
    if s.mode in ("local_sgd", "diloco") and config.checkpoint.every % s.local_steps:
        raise UserError(
            f"checkpoint.every = {config.checkpoint.every} must be a multiple of sync.local_steps = {s.local_steps}: "
            "replicas agree only right after an averaging"
        )


def check_muon(config: Config) -> None:
    """Muon's ranges; and the modes it is verified under: all-reduce data parallelism (DDP, ZeRO, TP, PP,
    CP, EP). A parameter server steps its own optimizer; local SGD, DiLoCo and replica groups are untested."""
    t, s = config.train, config.sync
    if t.muon_ns_steps < 1:
        raise UserError(f"train.muon_ns_steps = {t.muon_ns_steps} must be at least 1")
    if not 0 <= t.muon_momentum < 1:
        raise UserError(f"train.muon_momentum = {t.muon_momentum} must be in [0, 1)")
    if t.optimizer == "muon" and (s.mode != "allreduce" or s.fault_tolerant):
        mode = "sync.fault_tolerant" if s.mode == "allreduce" else f"sync.mode = {s.mode}"
        raise UserError(f"train.optimizer = muon runs with sync.mode = allreduce only, not {mode}: use adamw there")


def check_fault_tolerant(config: Config) -> None:
    """torchft replica groups average gradients across groups after backward: all-reduce modes only."""
    s, c = config.sync, config.comm
    if s.ft_group >= s.ft_groups:
        raise UserError(f"sync.ft_group = {s.ft_group} must be below sync.ft_groups = {s.ft_groups}")
    if s.ft_min_groups > s.ft_groups:
        raise UserError(f"sync.ft_min_groups = {s.ft_min_groups} exceeds sync.ft_groups = {s.ft_groups}")
    if s.ft_timeout_s <= 0:
        raise UserError(f"sync.ft_timeout_s = {s.ft_timeout_s} must be positive")
    if s.mode != "allreduce" or c.compression != "none" or config.parallel.zero == 1:
        raise UserError(
            "sync.fault_tolerant = true averages gradients across replica groups itself: it needs sync.mode = "
            "allreduce, comm.compression = none and parallel.zero 0, 2 or 3"
        )
    if config.precision.dtype == "fp16":
        raise UserError(
            "sync.fault_tolerant = true keeps no loss scale across groups: use precision.dtype bf16 or fp32"
        )
    if config.parallel.cpu_offload:  # on GPUs the offloaded shards would reach torchft's NCCL group on the host
        raise UserError(
            "sync.fault_tolerant = true (--replicas) averages gradients on the device across groups: set "
            "parallel.cpu_offload = false"
        )
