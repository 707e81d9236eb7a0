"""Which of a device's parameters train, and the optimizer state they carry (`paralm.plan.memory` prices them).

- LoRA (`train.lora_rank`, `paralm.convert.lora`): the base model is frozen, weights only (no gradients, no
  optimizer state; ZeRO-3 still shards them); every block adds its adapters, which train. Tensor parallelism
  splits half of each adapter as it splits the layer's weight and keeps the other half whole on every rank.
- the optimizer's fp32 tensors per trained parameter: AdamW's two moments, none for paralm's SGD; Muon
  (`paralm.train.optim.muon`) keeps one momentum buffer on the blocks' matrices (of each, the share this
  device holds) and AdamW's two on the rest (embeddings, head, norms, biases). Counted per device, since
  pipeline ranks differ: the first holds the embedding, the last the head.
"""

from __future__ import annotations

from paralm.models.shape import ModelShape
from paralm.plan.layout import Layout, Rank, Workload


def rank_adapter_params(work: Workload, layout: Layout, rank: Rank) -> float:
    """LoRA's adapters on one device of `rank` (0 without LoRA)."""
    if work.lora_adapters is None:
        return 0.0
    split, whole = work.lora_adapters
    return rank.layers * (split / layout.tp + whole)


def block_matrix_params(shape: ModelShape, layout: Layout) -> float:
    """One block's weight matrices on a device (what Muon steps): tensor parallelism splits all but the whole
    ones; MoE blocks' routers and shared experts (replicated over tp) in place of the dense feed-forward, spread
    over all blocks. The routed experts are apart (`memory.rank_expert_params`)."""
    block = shape.layer_matrix_params / layout.tp + shape.layer_whole_params
    moe = shape.moe
    if moe is not None:
        expert = sum(r * c * k for r, c, k in moe.expert_matrices)
        dense_ffn = sum(r * c * k for r, c, k in moe.dense_ffn_matrices)
        block += moe.layers / shape.n_layer * (moe.router_params + moe.shared * expert - dense_ffn / layout.tp)
    return block


def rank_optimizer_slots(work: Workload, layout: Layout, rank: Rank, trained: float) -> float:
    """fp32 optimizer tensors per parameter of the `trained` ones of `rank` outside the routed experts: for
    Muon, 1 on its block matrices and 2 on the rest; else the optimizer's own."""
    if not work.muon or not trained:
        return work.optimizer_slots
    return 2 - rank.layers * block_matrix_params(work.shape, layout) / trained


def expert_slots(work: Workload) -> float:
    """fp32 optimizer tensors per routed-expert parameter: the experts are matrices, one for Muon."""
    return 1.0 if work.muon else work.optimizer_slots
