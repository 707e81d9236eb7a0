"""The step engine: what computing a step needs, whoever drives the steps.

The training loop (`paralm.train.trainer`) and a parameter-server worker (`paralm.param_server.worker`)
both read batches, run forward and backward, and evaluate; only what happens to the gradients
differs (an optimizer step here, a push to the servers there). This is that shared part: the
datasets and batch layout, the model built on the meta device through its family's spec and
parallelized, and the calls on them.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from paralm.config.degrees import resolve_grad_accum
from paralm.config.rules import check_vocab_size
from paralm.config.schema import Config
from paralm.convert.hooks import after_step_hooks
from paralm.convert.masks import Masks
from paralm.data.mixture import MixedData
from paralm.data.prepare import data_sources, dataset_dir
from paralm.data.sampler import BatchLayout
from paralm.models.mtp import PredictionHook, mtp_weight
from paralm.models.registry import model_shape, model_spec
from paralm.models.step import StepBatch
from paralm.parallel.parallelize import parallelize
from paralm.parallel.precision import LossScaler
from paralm.parallel.runtime import Runtime
from paralm.sync.choose import build_sync
from paralm.train.checkpoint.choose import check_adapters, checkpoint_to_resume
from paralm.train.checkpoint.init_from import init_checkpoint, init_source, load_init
from paralm.train.checkpoint.masked import MaskedState, run_masks
from paralm.train.checkpoint.store import load_checkpoint
from paralm.train.validation import validation_loss


class StepEngine:
    def __init__(self, config: Config, runtime: Runtime) -> None:
        self.config, self.runtime, self.device = config, runtime, runtime.device
        t = config.train
        if runtime.local_rank == 0:  # one preparer per node; the others then find it done
            dataset_dir(config.data)
        runtime.barrier()
        sources = data_sources(config.data)
        self.train_data = MixedData(sources, "train", config.model.block_size)
        self.val_data = MixedData(sources, "val", config.model.block_size)
        check_vocab_size(config, self.train_data.vocab_size, sources[0].path)
        # this rank's share of each batch: a slice of the global batch (a parameter-server worker may
        # take a whole batch of its own instead); fault-tolerant replica groups split it first
        groups = config.sync.replica_groups
        dp = runtime.dims.dp * groups
        self.layout = BatchLayout(dp, resolve_grad_accum(config, dp), t.micro_batch_size)
        self.dp_rank = config.sync.ft_group * runtime.dims.dp + runtime.dp_rank if groups > 1 else runtime.dp_rank

        with torch.device("meta"):  # no memory yet: parallelize gives each rank its shards of the seeded init
            self.model = model_spec(config.model).build(config.model)
        self.shape = model_shape(config.model)
        self.plan = parallelize(self.model, runtime, config)
        self.module = self.plan.module
        self.sync = build_sync(self.plan, config)  # how replicas agree (`paralm.sync`)
        self.resume_from = checkpoint_to_resume(config)
        self.init_from = init_source(config, self.resume_from)  # a new run's weights: another model's
        # a pruned run keeps its masks (`paralm prune`), and so does a run started from one
        pruned = run_masks(config, self.resume_from or init_checkpoint(self.init_from))
        if self.resume_from is not None:  # after a pruned run's refusal of LoRA, which says more
            check_adapters(self.resume_from, config.train.lora_rank)
        self.masks = Masks(self.plan.model, pruned) if pruned else None
        self.hooks = after_step_hooks(self.plan.model, self.runtime.dp_group, self.masks)
        if getattr(config.model, "mtp_depth", 0):  # multi-token prediction: its weight per step, `mtp_loss` in rows
            weight = partial(mtp_weight, first=t.mtp_weight, after=t.mtp_weight_after, switch=t.mtp_weight_step)
            self.hooks.append(PredictionHook(self.plan.model, weight))
        # fp16's loss scale multiplies the loss before backward; the optimizer step unscales (the trainer's)
        self.scaler = LossScaler(config.precision.dtype, self.device, self.plan.scaler_group)

    @property
    def group_batch(self) -> int:
        """The samples this job computes per step: the global batch, less the other replica groups' shares."""
        return self.layout.global_batch // self.config.sync.replica_groups

    @property
    def tokens_per_step(self) -> int:
        """The tokens each step trains on, which the rows' tokens/s and MFU count: the job's samples, whole."""
        return self.group_batch * self.config.model.block_size

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> Stateful:
        """Model, optimizer and strategy state as checkpoints save and load it, with the pruning masks where
        the run has them."""
        state = self.sync.checkpoint_state(self.module, optimizer)
        return MaskedState(state, self.masks) if self.masks else state

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip where the sync strategy holds the gradients by now (ZeRO-1: on its shards); the norm before."""
        return self.sync.clip_grad_norm_(self.plan.model, max_norm, self.runtime, self.plan.tied)

    def resume(self, state: Stateful | nn.Module) -> dict[str, Any] | None:
        """Load the checkpoint `checkpoint.resume` names into `state` (collective over the ranks that
        step together); returns its trainer state, or None when the run starts fresh (from
        `checkpoint.init_from`'s weights where it names some)."""
        path = self.resume_from
        if path is None and self.init_from:
            load_init(self.init_from, self.plan.model, self.config, self.runtime.group, self.masks)
        return None if path is None else load_checkpoint(path, state, self.runtime.group)

    def step_batch(self, start: int = 0) -> StepBatch:
        """This rank's micro-batches of the batch whose first sample is `start` (with each token's document
        under `data.document_mask`). With a loss mask every rank counts the whole global batch's trained
        targets from the masks, so the loss is normalised before backward with no collective."""
        size, seed, data = self.layout.micro_batch_size, self.config.train.seed, self.train_data
        batch = StepBatch()
        if data.has_loss_mask:
            batch.trained = data.trained_tokens(seed, start, self.layout.global_batch)
            # the gradients averaged into one update: of the ranks the layout splits the batch over (every
            # replica group's; an asynchronous parameter-server worker's batch is its own), each with its cp ranks
            replicas = self.layout.dp_size * self.runtime.dims.cp
            batch.loss_tokens = max(batch.trained, 1) / replicas
            groups = self.config.sync.replica_groups
            if groups > 1:  # each group logs the loss of the share it read, as it does without a mask
                own = start + self.config.sync.ft_group * self.group_batch
                batch.trained = data.trained_tokens(seed, own, self.group_batch)
                batch.reported_tokens = max(batch.trained, 1) / (replicas // groups)
        for first in self.layout.micro_batch_starts(start, self.dp_rank):
            micro = [*data.sample(seed, first, size)]
            if self.config.data.document_mask:
                micro.append(data.documents(seed, first, size))
            batch.micro_batches.append(tuple(to_device(t, self.device) for t in micro))
        return batch

    def forward_backward(self, batch: StepBatch) -> torch.Tensor:
        """Accumulate gradients over the micro-batches, syncing only on the last; returns this rank's
        mean loss over them (0 on pipeline ranks without the last stage), or with a loss mask its share of the
        masked loss its job logs (`StepBatch.reported_tokens`)."""
        loss = self.plan.forward_backward(batch, self.scaler.scale)
        return loss if batch.reported_tokens is None else loss * (batch.loss_tokens / batch.reported_tokens)

    def evaluate(self) -> dict[str, float]:
        """Validation loss (collective over the ranks that step together): `val_loss`, and with a mixture
        each source's as `val_loss/NAME` and their mean weighted as the mixture samples them."""
        t = self.config.train
        losses = {}
        for source, data in zip(self.val_data.sources, self.val_data.datasets, strict=True):
            losses[f"val_loss/{source.name}"], _ = validation_loss(
                self.module,
                self.plan.eval_loss,
                data,
                self.runtime,
                t.eval_samples,
                t.micro_batch_size,
                t.seed,
                self.device,
                self.config.data.document_mask,
            )
        if len(losses) == 1:
            return {"val_loss": next(iter(losses.values()))}
        weights = [s.weight for s in self.val_data.sources]
        return {"val_loss": sum(w * v for w, v in zip(weights, losses.values(), strict=True)), **losses}

    def data_positions(self, samples_seen: int) -> dict[str, int]:
        """Samples each source has given so far (for the checkpoint; empty with a single source)."""
        if len(self.train_data.sources) == 1:
            return {}
        return self.train_data.positions(self.config.train.seed, samples_seen)

    def describe(self) -> str:
        """The model and how each step's batch is laid out, for the start-up line."""
        layout, m = self.layout, self.config.model
        return (
            f"{self.shape.flops_params / 1e6:.2f}M parameters ({m.family}, {m.n_layer} layers, d_model {m.d_model}), "
            f"{self.runtime.world_size} rank(s) on {self.device.type}, dp {layout.dp_size}, "
            f"global batch {layout.global_batch} = {layout.dp_size} x {layout.grad_accum} x "
            f"{layout.micro_batch_size} sequences of {m.block_size} tokens, {self.config.precision.dtype}"
        )


def pins_host_memory(device: torch.device) -> bool:
    """Whether a host tensor is copied to `device` from pinned memory: on a GPU a copy from pageable memory
    first waits for the work queued before it, from pinned memory it does not."""
    return device.type == "cuda"


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (host memory) on `device`, without the host waiting for the device. The pinned copy is
    contiguous: a strided one would be made contiguous again in pageable memory before the transfer."""
    if pins_host_memory(device):
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
    return tensor.to(device, non_blocking=True)
