"""Model-state memory per rank: counted from the tensors this rank holds, beside the ZeRO paper's prediction.

Rajbhandari et al. 2020 (ZeRO, section 3) count model state per parameter. With mixed-precision
Adam: 2 bytes of fp16 parameters, 2 of fp16 gradients, K = 12 of optimizer state (fp32 master
copy, momentum, variance). Stage 1 shards the optimizer state over the N data-parallel ranks,
stage 2 also the gradients, stage 3 also the parameters:

    mixed precision, Adam:  ZeRO-0 16Ψ,  ZeRO-1 4Ψ + 12Ψ/N,  ZeRO-2 2Ψ + 14Ψ/N,  ZeRO-3 16Ψ/N
    fp32, Adam (4 + 4, K = 8: no separate master copy):
                            ZeRO-0 16Ψ,  ZeRO-1 8Ψ + 8Ψ/N,   ZeRO-2 4Ψ + 12Ψ/N,  ZeRO-3 16Ψ/N
    SGD (no momentum): K = 0 in fp32, K = 4 (the master copy) in mixed precision.
    Muon (`paralm.train.optim.muon`): one fp32 momentum buffer on its matrices (a share f of Ψ), AdamW's
    two moments on the rest: K = 4(2 - f) in fp32, 4 + 4(2 - f) in mixed precision.

What is counted (unique tensors, a DTensor by its local shard):
- parameters: after each training forward, those the module holds (gathered by FSDP where it keeps
  them for backward) together with the optimizer's (FSDP's sharded fp32 masters);
- gradients: at the end of the last backward, before the optimizer step and any sync paralm runs
  after backward (ZeRO-1's reduce-scatter follows, so its rank still holds every gradient, where
  the paper and the planner count the shard it keeps; FSDP has reduce-scattered its own, so only
  the shard: what it accumulated unsharded before is transient);
- optimizer state: after the step (ZeRO-1: the local partition's).
Where PyTorch keeps more than the paper's accounting, the measurement says so: FSDP's ZeRO-2 holds
the gathered parameters and the sharded master copy (+4Ψ/N in fp32); autocast and FSDP's mixed
precision keep fp32 master weights and fp32 gradients where the paper has fp16 ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paralm.config.schema import Config
from paralm.config.zero import is_sharded, per_rank
from paralm.models.registry import model_spec
from paralm.models.step import StepHook
from paralm.train.optim.muon import muon_matrices

MiB = 2**20


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each part of the model state, in the paper's accounting."""

    params: float
    grads: float
    optim: float

    @classmethod
    def of(cls, dtype: str, optimizer: str, muon_share: float = 0.0) -> StateBytes:
        """`muon_share`: the share of the parameters Muon steps (`optimizer` muon), one fp32 slot each."""
        slots = {"adamw": 2.0, "sgd": 0.0, "muon": 2.0 - muon_share}[optimizer]
        if dtype == "fp32":
            return cls(4, 4, 4 * slots)
        return cls(2, 2, 4 + 4 * slots)  # + the fp32 master copy


@dataclass(frozen=True)
class ZeroPrediction:
    """The paper's model-state bytes per rank for one stage, N shards and Ψ parameters."""

    stage: int
    shards: int
    num_params: int
    per_param: StateBytes

    def _parts(self) -> dict[str, int]:
        return dataclasses.asdict(self.per_param)

    def _split(self) -> tuple[int, int]:
        """(replicated, sharded) bytes per parameter."""
        parts = self._parts()
        sharded = sum(n for part, n in parts.items() if is_sharded(part, self.stage))
        return sum(parts.values()) - sharded, sharded

    @property
    def bytes(self) -> float:
        return self.num_params * sum(per_rank(self._parts(), self.stage, self.shards).values())

    @property
    def formula(self) -> str:
        replicated, sharded = self._split()
        terms = [f"{replicated:.3g}Ψ"] if replicated else []
        terms += [f"{sharded:.3g}Ψ/N"] if sharded else []
        return " + ".join(terms) or "0"


def predict(config: Config, model: nn.Module, stage: int, shards: int) -> ZeroPrediction:
    """The prediction for the ZeRO `stage` in effect over `shards` data-parallel shards, Ψ being the
    parameters of this rank's model-parallel part (its pipeline stages, its tensor-parallel shards)."""
    num_params = sum(_tensor_parallel_numel(p) for p in model.parameters())
    muon_share = 0.0
    if config.train.optimizer == "muon" and num_params:
        matrices = muon_matrices(model, model_spec(config.model).blocks)
        muon_share = sum(_tensor_parallel_numel(p) for p in matrices) / num_params
    per_param = StateBytes.of(config.precision.dtype, config.train.optimizer, muon_share)
    return ZeroPrediction(stage, shards, num_params, per_param)


def _tensor_parallel_numel(param: torch.Tensor) -> int:
    """Elements of `param` on this tensor-parallel rank: a DTensor sharded over the `tp` mesh dim counts
    its share; data-parallel (FSDP) sharding is the formula's N, so it counts whole there."""
    numel = param.numel()
    if isinstance(param, DTensor):
        names = param.device_mesh.mesh_dim_names or ()
        for dim, (name, placement) in enumerate(zip(names, param.placements, strict=True)):
            if name == "tp" and placement.is_shard():
                numel //= param.device_mesh.size(dim)
    return numel


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct tensors this rank holds (a tied weight once, a DTensor by its shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        seen[local.data_ptr()] = local.numel() * local.element_size()
    return sum(seen.values())


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class ModelStateMeter(StepHook):
    """Measures parameter, gradient and optimizer-state bytes of one training step on this rank.

    The optimizer state counted is what this rank holds: `optimizer`'s, or that of the local optimizer a
    sharding wrapper steps (ZeRO-1's partition, its `inner`). Counting walks every tensor, so it runs only on steps
    with `measuring` set (the trainer: the first, then every `log.every`-th); the other steps report
    the last measurement."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.stepped = getattr(optimizer, "inner", optimizer)
        self.measuring = True
        self._param_bytes = self._grad_bytes = 0
        self._last: dict[str, int] = {}
        model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: nn.Module, args: object, output: object) -> None:
        # traced into a compiled step (`train.compile = "model"`) it would recompile it whenever `measuring` flips;
        # `after_backward` counts what is held then instead, the same where that compiles (no FSDP)
        if torch.compiler.is_compiling():
            return
        if self.measuring and torch.is_grad_enabled():  # training, not evaluation
            held = local_bytes([*module.parameters(), *_optimizer_params(self.optimizer)])
            self._param_bytes = max(self._param_bytes, held)

    def after_backward(self) -> None:
        if not self.measuring:
            return
        params = [*self.model.parameters(), *_optimizer_params(self.optimizer)]
        self._grad_bytes = local_bytes(p.grad for p in params)
        # pipeline stages run submodules, so the forward hook may not have fired: count what is held now
        self._param_bytes = max(self._param_bytes, local_bytes(params))

    def ended(self, step: int, skipped: torch.Tensor) -> dict[str, int]:
        """The step's metrics (`param_bytes`, `grad_bytes`, `optim_bytes`), then reset for the next."""
        if not self.measuring:
            return self._last
        state = self.stepped.state.values()
        optim = local_bytes(v for per_param in state for v in per_param.values() if isinstance(v, torch.Tensor))
        row = {"param_bytes": self._param_bytes, "grad_bytes": self._grad_bytes, "optim_bytes": optim}
        self._param_bytes = self._grad_bytes = 0
        self._last = row
        return row


def describe_prediction(prediction: ZeroPrediction, dtype: str, optimizer: str) -> str:
    """The start-up line: which formula applies and what it predicts."""
    accounting = "mixed-precision" if dtype != "fp32" else "fp32"
    return (
        f"memory: ZeRO-{prediction.stage} over N = {prediction.shards}, {accounting} {optimizer}: the ZeRO paper "
        f"predicts {prediction.formula} = {prediction.bytes / MiB:,.1f} MiB of model state per rank "
        f"(Ψ = {prediction.num_params:,} parameters)"
    )


def describe_measured(row: dict[str, float], prediction: ZeroPrediction) -> str:
    """The line after the first step: what this rank holds, against the prediction."""
    total = row["param_bytes"] + row["grad_bytes"] + row["optim_bytes"]
    return (
        f"memory per rank (the largest) after the first step: parameters {row['param_bytes'] / MiB:,.1f} + gradients "
        f"{row['grad_bytes'] / MiB:,.1f} + optimizer state {row['optim_bytes'] / MiB:,.1f} = {total / MiB:,.1f} MiB "
        f"({total / prediction.bytes:.2f} x predicted); peak {row['peak_mem_bytes'] / MiB:,.0f} MiB"
    )
