"""Which layers each pipeline stage holds: balanced by estimated cost, or as `parallel.pp_split` says.

A pipeline runs at the pace of its slowest stage, so layers are split to make the stages' estimated
costs as equal as possible, not their layer counts. The estimate is training FLOPs per token from the
family's closed-form shape, in the convention of `ModelShape.flops_per_token` (forward + backward =
3 x forward, 2 FLOPs per multiply-add):
- a block: 6 x its weight matrices + 12·s·h (QKᵀ and AV over s positions);
- the LM head: 6 x its matrix, several blocks' worth when the vocabulary is large next to the width;
- the embeddings: no multiply, but each token reads a row of each table (token, and learned
  positions where the family has them) and the backward adds into it: 2 passes over h per table.
The first stage carries the embeddings and the last the head, on top of their blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from paralm.config.rules import check_split
from paralm.models.shape import ModelShape


@dataclass(frozen=True)
class PartCosts:
    """Estimated training FLOPs per token of the model's parts."""

    embedding: float
    block: float
    head: float


def part_costs(shape: ModelShape) -> PartCosts:
    h, tables = shape.d_model, 2 if shape.position_params else 1
    return PartCosts(
        embedding=2.0 * h * tables,
        block=6.0 * (shape.layer_matrix_params + shape.layer_whole_params) + 12.0 * shape.block_size * h,
        head=6.0 * shape.head_matrix_params,
    )


@dataclass(frozen=True)
class StageSplit:
    """Layers per stage (in stage order) and each stage's estimated cost."""

    layers: tuple[int, ...]
    costs: tuple[float, ...]
    balanced: bool  # False: given by parallel.pp_split

    def layer_range(self, stage: int) -> range:
        start = sum(self.layers[:stage])
        return range(start, start + self.layers[stage])

    def shares(self) -> list[float]:
        total = sum(self.costs)
        return [c / total for c in self.costs]

    def describe(self, stage_to_rank: dict[int, int]) -> str:
        """One line per stage: its layers, extra parts, rank and share of the estimated cost."""
        how = "balanced by estimated cost" if self.balanced else "from parallel.pp_split"
        lines = [f"pipeline split ({how}), {len(self.layers)} stages:"]
        for stage, share in enumerate(self.shares()):
            layers = self.layer_range(stage)
            span = f"layer {layers.start}" if len(layers) == 1 else f"layers {layers.start}-{layers.stop - 1}"
            extra = (" + embedding" if stage == 0 else "") + (" + head" if stage == len(self.layers) - 1 else "")
            lines.append(
                f"  stage {stage} (pp rank {stage_to_rank[stage]}): {span}{extra}, {share:.1%} of the estimated cost"
            )
        return "\n".join(lines)


def stage_costs(layers: list[int] | tuple[int, ...], costs: PartCosts) -> tuple[float, ...]:
    last = len(layers) - 1
    return tuple(
        n * costs.block + (costs.embedding if i == 0 else 0.0) + (costs.head if i == last else 0.0)
        for i, n in enumerate(layers)
    )


def balanced_split(n_layer: int, stages: int, costs: PartCosts) -> list[int]:
    """Contiguous layer counts (each at least 1) that minimise the most expensive stage and, among
    those, spread the rest as evenly as they can (least sum of squared stage costs).

    The smallest feasible cap is found by bisecting over the stage costs that can occur; each test is a
    dynamic programme over (stages used, layers placed), O(stages · n_layer²). Deterministic, so every
    rank computes the same split.
    """
    if n_layer < stages:
        raise ValueError(f"{n_layer} layers cannot fill {stages} stages")
    caps = sorted({_cost(stage, count, stages, costs) for stage in range(stages) for count in range(1, n_layer + 1)})
    low, high = 0, len(caps) - 1  # the largest cap always admits a split
    while low < high:
        middle = (low + high) // 2
        if _least_squares_split(n_layer, stages, costs, caps[middle]) is None:
            low = middle + 1
        else:
            high = middle
    return _least_squares_split(n_layer, stages, costs, caps[low])


def _cost(stage: int, count: int, stages: int, costs: PartCosts) -> float:
    extra = (costs.embedding if stage == 0 else 0.0) + (costs.head if stage == stages - 1 else 0.0)
    return count * costs.block + extra


def _least_squares_split(n_layer: int, stages: int, costs: PartCosts, cap: float) -> list[int] | None:
    """The split with every stage at most `cap` and the least sum of squared costs, or None."""
    # best[i]: (sum of squares, layer counts) placing the first i layers on the stages so far
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for stage in range(stages):
        following = stages - stage - 1  # stages still to fill, one layer each at least
        step: dict[int, tuple[float, tuple[int, ...]]] = {}
        for placed, (squares, counts) in best.items():
            for count in range(1, n_layer - following - placed + 1):
                cost = _cost(stage, count, stages, costs)
                if cost > cap:
                    break
                candidate = (squares + cost * cost, (*counts, count))
                if placed + count not in step or candidate[0] < step[placed + count][0]:
                    step[placed + count] = candidate
        best = step
    return list(best[n_layer][1]) if n_layer in best else None


def stage_split(shape: ModelShape, stages: int, override: list[int]) -> StageSplit:
    """The split to run: `override` (parallel.pp_split) when given, else the balanced one."""
    costs = part_costs(shape)
    if override:
        check_split(override, shape.n_layer, stages)
        return StageSplit(tuple(override), stage_costs(override, costs), balanced=False)
    layers = balanced_split(shape.n_layer, stages, costs)
    return StageSplit(tuple(layers), stage_costs(layers, costs), balanced=True)
