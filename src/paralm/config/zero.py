"""What each ZeRO stage shards (Rajbhandari et al. 2020, section 3): stage 1 the optimizer state,
stage 2 also the gradients, stage 3 also the parameters. One formula for the memory meter's
prediction and the planner's cost model."""

from __future__ import annotations

SHARDED_FROM_STAGE = {"params": 3, "grads": 2, "optim": 1}


def is_sharded(part: str, stage: int) -> bool:
    return stage >= SHARDED_FROM_STAGE[part]


def per_rank(bytes_per_part: dict[str, float], stage: int, shards: int) -> dict[str, float]:
    """Bytes one rank holds of each part (`params`, `grads`, `optim`) under ZeRO `stage` over `shards` ranks."""
    return {part: size / (shards if is_sharded(part, stage) else 1) for part, size in bytes_per_part.items()}
