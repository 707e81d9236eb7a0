"""Memory per device: model states, activations, embeddings, logits and loss, buffers; each term separately.

Model states follow Rajbhandari et al. 2020 (ZeRO, sec. 3 and 5): stage 1 shards the optimizer state,
stage 2 also the gradients, stage 3 also the parameters, over the `dp_shard` (x cp) ranks; only parameters
that train have gradients and optimizer state (LoRA freezes the base; `paralm.plan.trained`). Activations
follow Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer Models, sec. 4),
in bytes per layer for 16-bit activations with 1-byte dropout masks, generalised to any element size
and to the widths each family's `ModelShape` states (grouped-query k and v, a gated MLP's tensors).
The total is a sum of every term alive at the start of backward, the peak of a training step.
Gradients in the model states are those the optimizer steps with, the ZeRO paper's accounting: a
rank's shard under ZeRO-1/2/3. What a rank holds beyond them on the way is a buffer: ZeRO-1's whole
local gradients until its reduce-scatter after backward (the trainer's meter, which reads gradients
at the end of backward, counts them as states: 8 bytes per parameter more in fp32), and FSDP's
unsharded gradients accumulated between micro-steps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from paralm.config.zero import per_rank
from paralm.models.shape import ModelShape
from paralm.plan.cluster import Cluster
from paralm.plan.head import loss_bytes, resolved
from paralm.plan.layout import DTYPE_BYTES, Layout, Rank, Workload
from paralm.plan.trained import expert_slots, rank_adapter_params, rank_optimizer_slots

# Bytes per parameter for a 16-bit compute dtype: (parameters, gradients, fp32 master copy). The
# optimizer adds 4 bytes per fp32 slot. In fp32 every recipe is (4, 4, 0): the parameters are the master.
STATE_RECIPES: dict[str, tuple[int, int, int]] = {
    # ZeRO paper, sec. 3.1: fp16 parameters and gradients, fp32 master weights (K = 12 with Adam).
    "paper": (2, 2, 4),
    # Megatron-LM and DeepSpeed's bf16 optimizer: gradients accumulate in an fp32 buffer ("main_grad").
    "fp32-grads": (2, 4, 4),
    # torch.autocast / FSDP2 MixedPrecisionPolicy, what paralm trains with: fp32 parameters are the
    # master copy, fp32 gradients; 16-bit copies exist only transiently (counted as buffers).
    "fp32-master": (4, 4, 0),
}


@dataclass(frozen=True)
class ModelStates:
    param_bytes: float
    grad_bytes: float
    optim_bytes: float


def state_bytes(element_bytes: int, recipe: str) -> tuple[int, int, int]:
    """Bytes per parameter (parameters, gradients, fp32 master copy) under `recipe` at this compute width."""
    return STATE_RECIPES[recipe] if element_bytes < 4 else (4, 4, 0)


@functools.cache  # pure, and asked again for every micro-batch size and checkpointing choice of a layout
def model_states(
    params: float, dtype: str, recipe: str, optimizer_slots: float, zero: int, shards: int, trained: float | None = None
) -> ModelStates:
    """Parameter, gradient and optimizer bytes on one device holding a 1/`shards` ZeRO shard. Of the `params`,
    `trained` (all by default) have gradients and optimizer state; the rest (LoRA's frozen base) weights only."""
    param, grad, master = state_bytes(DTYPE_BYTES[dtype], recipe)
    trained = params if trained is None else trained
    optim = master + 4 * optimizer_slots
    held = per_rank({"params": params * param, "grads": trained * grad, "optim": trained * optim}, zero, shards)
    return ModelStates(param_bytes=held["params"], grad_bytes=held["grads"], optim_bytes=held["optim"])


@functools.cache  # pure; the search asks for the same few shapes many times
def layer_activation_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    *,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    element_bytes: int = 2,
    dropout: bool = True,
    flash: bool = False,
    split_width: int | None = None,
) -> float:
    """Activations one transformer layer keeps for backward (Korthikanti et al. 2022, sec. 4.1-4.3).

    s sequence, b micro-batch, h hidden, a heads, t tensor-parallel degree, sp sequence parallel.
    recompute: none | selective (Korthikanti's: recompute the attention core, drop the 5as/h term) |
    full (keep only the layer input, 2sbh). With 16-bit elements and dropout the paper's forms hold:
    none sbh(34 + 5as/h), TP sbh(10 + 24/t + 5as/(ht)), TP+SP sbh/t (34 + 5as/h).
    `flash`: attention by a fused kernel (FlashAttention, Dao et al. 2022; torch's SDPA) stores no
    s x s matrix but its output and the log-sum-exp (fp32, a*s*b), as paralm's model does.
    `split_width`: elements per token of what TP splits, attention's and the MLP's saved tensors
    (`ModelShape.attention_saved + mlp_saved`); the paper's GPT's 12h by default.
    """
    sbh, e, mask = s * b * h, element_bytes, 1 if dropout else 0
    seq_split = t if sp else 1  # SP shards what TP alone replicates along the sequence
    if recompute == "full":
        return e * sbh / seq_split
    # Replicated across TP ranks without SP: both norms' inputs (fused LayerNorm and RMSNorm kernels
    # alike keep their input and per-token statistics, left out as in the paper; torch's composite
    # RMSNorm on CPU also keeps its normalised output), the q/k/v input and the MLP input (4 sbh
    # elements), and the two residual dropout masks.
    replicated = (4 * e + 2 * mask) * sbh
    # Split by TP: Q, K, V and the out projection's input (4 sbh elements in the paper's GPT), the
    # MLP's inner tensors (GELU input and the down-projection input, 4 + 4 sbh).
    split = e * s * b * (12 * h if split_width is None else split_width)
    if flash:
        split += e * sbh + 4 * a * s * b  # the kernel keeps its own output and the log-sum-exp
    elif recompute == "none":
        split += (2 * e + mask) * a * s * s * b  # softmax output, its dropout output and mask
    return replicated / seq_split + split / t


def backward_working_set(
    tokens: int, h: int, t: int, sp: bool, element_bytes: int, mlp_grads: int | None = None
) -> float:
    """Gradients alive at once inside one block's backward, beyond the stored activations: through the
    MLP, the gradient of its output (sbh) and `mlp_grads` inner ones per token, split by TP (a GELU's
    output and input, 4 sbh each, by default). The paper's counts leave these transients out; we
    measured them on CPU (benchmarks/planner_validation)."""
    inner = 8 * h if mlp_grads is None else mlp_grads
    return element_bytes * tokens * (h / (t if sp else 1) + inner / t)


@dataclass(frozen=True)
class Memory:
    """Bytes on the most loaded device, by term."""

    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    activation_bytes: float  # transformer blocks: every micro-batch in flight, plus backward's working set
    embedding_bytes: float  # the embedding's dropout mask (its output is the first block's input)
    logits_bytes: float  # final norm, logits and loss, as `train.loss_impl` holds them (`paralm.plan.head`)
    buffer_bytes: float  # communication and cast buffers
    runtime_bytes: float  # the stated allowance of the device's runtime

    @property
    def total(self) -> float:
        return sum(vars(self).values())


def rank_params(shape: ModelShape, layout: Layout, rank: Rank) -> float:
    """Parameters on one device of `rank`: TP splits the matrices, column-parallel biases and the
    vocabulary (Shoeybi et al. 2019, Megatron-LM sec. 3), and replicates norms, row-parallel biases and
    position embeddings. An untied head is the last rank's own; with a pipeline, a tied head is a copy
    of the embedding on the last rank (as Megatron). MoE blocks add their router, shared and routed experts
    (`rank_expert_params`) in place of the dense feed-forward; paralm replicates those over tp."""
    t = layout.tp
    total = rank.layers * block_params(shape, layout)
    if rank.has_embedding:
        total += shape.embedding_params / t + shape.position_params
    if rank.has_head:
        tied_copy = shape.embedding_params if not shape.head_params and not rank.has_embedding else 0
        total += shape.final_norm_params + (shape.head_params + tied_copy) / t
    return total


def block_params(shape: ModelShape, layout: Layout) -> float:
    """One block's parameters on a device, MoE blocks' spread over all blocks."""
    t, moe = layout.tp, shape.moe
    block = (shape.layer_matrix_params + shape.layer_column_bias_params) / t + shape.layer_replicated_params
    if moe is not None:
        routed = moe.experts * moe.expert_params / layout.ep
        block += moe.layers / shape.n_layer * (moe.router_params + moe.shared * moe.expert_params + routed)
        block -= moe.layers / shape.n_layer * moe.dense_ffn_params / t
    return block


def rank_expert_params(shape: ModelShape, layout: Layout, rank: Rank) -> float:
    """The routed experts' parameters among `rank_params`: 1/ep of each of its MoE blocks' experts, which
    ZeRO shards over `Layout.expert_shards` ranks instead of `Layout.shards`."""
    moe = shape.moe
    if moe is None:
        return 0.0
    return rank.layers * moe.layers / shape.n_layer * moe.experts * moe.expert_params / layout.ep


def sharded_params(params: float, experts: float, layout: Layout) -> float:
    """The ZeRO shard of `params` (of which `experts` are routed experts) one device keeps."""
    return (params - experts) / layout.shards + experts / layout.expert_shards


def rank_held(layout: Layout, work: Workload, rank: Rank) -> tuple[float, float, float]:
    """(parameters, the routed experts among them, those that train) on one device of `rank`: all, or with LoRA
    its adapters, the only ones that train (`paralm.plan.trained`)."""
    params, experts = rank_params(work.shape, layout, rank), rank_expert_params(work.shape, layout, rank)
    adapters = rank_adapter_params(work, layout, rank)
    return params + adapters, experts, adapters if work.lora_adapters else params


def rank_memory(layout: Layout, work: Workload, cluster: Cluster, rank: Rank) -> Memory:
    shape, e = work.shape, work.element_bytes
    t, sp = layout.tp, layout.sequence_parallel and layout.tp > 1
    params, experts, trained = rank_held(layout, work, rank)
    states = _sharded_states(params, experts, trained, layout, work, rank)
    if layout.zero >= 2 and layout.shards > 1:
        states = _fsdp_states(states, params, experts, layout, work)
    elif layout.zero == 1 and layout.dp_shard > 1:  # paralm.sync.zero1 keeps the averaged gradient shard
        states = ModelStates(states.param_bytes, states.grad_bytes / layout.dp_shard, states.optim_bytes)
    if layout.ps_servers:  # the servers keep the optimizer state (and step it)
        states = ModelStates(states.param_bytes, states.grad_bytes, 0.0)
    elif work.sync == "diloco":  # DiLoCo (Douillard et al. 2023): fp32 anchor copy and outer momentum
        states = ModelStates(states.param_bytes, states.grad_bytes, states.optim_bytes + 8 * trained)

    b, s = layout.pipeline_batch, layout.sequence(shape)  # context parallelism: this rank's positions
    split_width = shape.attention_saved + shape.mlp_saved
    per_layer = dict(t=t, sp=sp, element_bytes=e, dropout=work.dropout, flash=True, split_width=split_width)
    stored = layer_activation_bytes(s, b, shape.d_model, shape.n_head, **per_layer)
    checkpointed = layer_activation_bytes(s, b, shape.d_model, shape.n_head, recompute="full", **per_layer)
    n_ckpt = layout.checkpointed_blocks(rank.layers)
    per_microbatch = n_ckpt * checkpointed + (rank.layers - n_ckpt) * stored
    in_flight = layout.schedule.in_flight(layout.pp, layout.pp_microbatches, layout.pp_virtual_stages, rank.index)
    # Backward recomputes one checkpointed block at a time: its full activations are a working set.
    recompute = stored if n_ckpt else 0.0
    working_set = backward_working_set(s * b, shape.d_model, t, sp, e, shape.mlp_grads)
    activations = per_microbatch * in_flight + recompute + working_set

    embedding = (s * b * shape.d_model / (t if sp else 1) * in_flight) if rank.has_embedding and work.dropout else 0.0
    head_in_flight = layout.pp_microbatches if layout.schedule.holds_all else 1
    impl = resolved(work, cluster, t)
    logits = loss_bytes(work, impl, s * b, t) * head_in_flight if rank.has_head else 0.0
    return Memory(
        states.param_bytes,
        states.grad_bytes,
        states.optim_bytes,
        activations,
        embedding,
        logits,
        buffer_bytes(layout, work, params, trained),
        cluster.runtime_bytes,
    )


def _sharded_states(
    params: float, experts: float, trained: float, layout: Layout, work: Workload, rank: Rank
) -> ModelStates:
    """Model states of a device whose routed experts (`experts` of `params`) are sharded over their own group,
    `trained` of `params` with gradients and optimizer state (`rank_held`)."""
    dense_trained = trained - experts
    slots = rank_optimizer_slots(work, layout, rank, dense_trained)
    dense = model_states(params - experts, work.dtype, work.recipe, slots, layout.zero, layout.shards, dense_trained)
    if not experts:
        return dense
    routed = model_states(experts, work.dtype, work.recipe, expert_slots(work), layout.zero, layout.expert_shards)
    return ModelStates(*(a + b for a, b in zip(vars(dense).values(), vars(routed).values(), strict=True)))


def _fsdp_states(states: ModelStates, params: float, experts: float, layout: Layout, work: Workload) -> ModelStates:
    """What FSDP2 holds beyond the paper's ZeRO-2 (see `paralm.train.memory`): with
    `reshard_after_forward=False`, as paralm stores states, the parameters gathered in the compute
    dtype stay from forward to the end of backward beside the sharded fp32 master copy."""
    if layout.zero == 2 and work.recipe == "fp32-master":
        param = params * work.element_bytes + sharded_params(params, experts, layout) * 4
        return ModelStates(param, states.grad_bytes, states.optim_bytes)
    return states


def stored_states(layout: Layout, work: Workload, rank: Rank) -> ModelStates:
    """The model states a device keeps between steps, as paralm stores them (the dry run's plan): the
    model states of `rank_memory` without ZeRO-2's parameters gathered for forward and backward (FSDP
    stores the fp32 shard only) and ZeRO-1's whole gradients before their reduce-scatter."""
    params, experts, trained = rank_held(layout, work, rank)
    states = _sharded_states(params, experts, trained, layout, work, rank)
    if layout.zero >= 2 and layout.shards > 1 and work.recipe == "fp32-master":
        return ModelStates(sharded_params(params, experts, layout) * 4, states.grad_bytes, states.optim_bytes)
    return states


def buffer_bytes(layout: Layout, work: Workload, params: float, trained: float) -> float:
    """Communication and cast buffers beyond the model states (stated assumptions):
    - ZeRO-3 gathers parameters in the compute dtype: two blocks at a time (the one computing and the
      one prefetched, FSDP's default) without a pipeline; the whole rank with one, since gathering
      per pipeline micro-batch would repeat every all-gather m times (torchtitan keeps them gathered);
      plus one block's unsharded gradients before their reduce-scatter;
    - otherwise, under mixed precision with fp32 parameters, autocast's cache of 16-bit weights (one
      copy of the rank's parameters, alive through the forward).
    - ZeRO-1 (paralm.sync.zero1): the whole local gradients during backward, until their
      reduce-scatter leaves the rank its shard (counted in the model states);
    - ZeRO-2/3 accumulating with sync off until the last micro-step (FSDP's default, unless
      `parallel.shard_grads_every_microstep`): the whole unsharded gradients between micro-steps,
      reduce-scattered to the shard (the model states) in the last backward;
    DDP's buckets are views of the gradients (paralm sets `gradient_as_bucket_view`), so cost nothing
    extra; NCCL's own buffers are part of the runtime allowance."""
    e, layer = work.element_bytes, block_params(work.shape, layout)
    param_bytes, grad_bytes, _ = state_bytes(e, work.recipe)
    accumulating = layout.zero >= 2 and layout.shards > 1 and layout.grad_accum > 1
    unsharded_grads = trained * grad_bytes if accumulating and not work.sharded_accumulation else 0.0
    if layout.zero == 1:
        unsharded_grads = trained * grad_bytes * (1 - 1 / layout.dp_shard)
    if layout.zero >= 3:
        gathered = params if layout.pp > 1 else 2 * layer
        return unsharded_grads + gathered * e + layer * DTYPE_BYTES[work.reduce_dtype]
    return unsharded_grads + (params * e if e < 4 and param_bytes == 4 else 0.0)


def device_memory(layout: Layout, work: Workload, cluster: Cluster) -> Memory:
    """The memory of the most loaded pipeline rank."""
    ranks = layout.critical_ranks(work.shape)
    return max((rank_memory(layout, work, cluster, r) for r in ranks), key=lambda m: m.total)
