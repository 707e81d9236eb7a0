"""Muon's counts from a model's shape (`paralm.plan.muon` prices them): the matrices it steps, their
parameters, the optimizer state slots per parameter, the Newton-Schulz FLOPs of one matrix."""

from __future__ import annotations

from collections import Counter

from paralm.models.shape import ModelShape
from paralm.train.optim.muon_owners import newton_schulz_cost


def muon_matrices(shape: ModelShape) -> tuple[tuple[int, int, int], ...]:
    """(rows, columns, how many) of every matrix Muon steps: the blocks' weights, router and experts."""
    dense = [(r, c, k * shape.n_layer) for r, c, k in shape.layer_matrices]
    moe = shape.moe
    if moe is None:
        return tuple(dense)
    replaced = Counter({(r, c): k * moe.layers for r, c, k in moe.dense_ffn_matrices})
    for i, (r, c, k) in enumerate(dense):  # once each, where attention has a matrix of the same shape
        taken = min(k, replaced[r, c])
        dense[i], replaced[r, c] = (r, c, k - taken), replaced[r, c] - taken
    experts = [(r, c, k * moe.experts * moe.layers) for r, c, k in moe.expert_matrices]
    experts += [(r, c, k * moe.layers) for r, c, k in moe.shared_matrices]
    router = (moe.router_params // shape.d_model, shape.d_model, moe.layers)
    return tuple(m for m in (*dense, *experts, router) if m[2] > 0)


def muon_params(shape: ModelShape) -> int:
    return sum(r * c * k for r, c, k in muon_matrices(shape))


def optimizer_slots(shape: ModelShape) -> float:
    """fp32 tensors per parameter: 1 on Muon's matrices, 2 (AdamW's moments) on the rest."""
    return 2 - muon_params(shape) / shape.params


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """`steps` iterations on a rows x cols matrix, as the optimizer weighs them to share them out."""
    return steps * newton_schulz_cost((rows, cols))
