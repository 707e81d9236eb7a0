"""The `[rl]` section: reinforcement learning from verifiable rewards (`paralm rl`, docs/rl.md).

Declared in the config floor like every section, so that `--rl.group_size=8` is checked and typed as any other
override; what runs it is the `paralm.rl` wing.
"""

from __future__ import annotations

from dataclasses import dataclass

from paralm.config.fields import option

RL_LOSSES = ("grpo", "dapo", "dr_grpo")
REWARD_SCALINGS = ("group", "batch", "none")


@dataclass
class RLConfig:
    prompts: str = option(
        "", "prompts: JSONL, Parquet or a datasets folder with a `prompt` string or `messages` list, and an `answer`"
    )
    group_size: int = option(8, "completions sampled per prompt (>= 2: the group is each one's baseline)")
    prompts_per_step: int = option(8, "prompts per step, split over the data-parallel ranks")
    max_new_tokens: int = option(64, "longest completion, in tokens")
    temperature: float = option(1.0, "sampling temperature of the rollouts (> 0)")
    top_p: float = option(1.0, "nucleus sampling: keep the smallest set of tokens with this probability")
    rewards: list[str] = option(
        ["exact_match"], "reward functions: exact_match, format, or module:function(prompt, completion, answer)"
    )
    reward_weights: list[float] = option([], "one weight per reward function; empty: 1 each")
    format_pattern: str = option(r"####\s*\S+", "the regex the `format` reward looks for in a completion")
    loss: str = option(
        "grpo", "grpo: mean over each sequence's tokens; dapo: over the batch's tokens; dr_grpo: constant", RL_LOSSES
    )
    scale_rewards: str = option(
        "group", "advantages divided by the rewards' std of the group, of the batch, or not at all", REWARD_SCALINGS
    )
    clip_low: float = option(0.2, "the ratio is clipped below at 1 - clip_low")
    clip_high: float = option(0.2, "the ratio is clipped above at 1 + clip_high (DAPO: 0.28)")
    kl_beta: float = option(0.0, "weight of the k3 KL estimate against the starting policy; 0 loads no reference")
    updates_per_rollout: int = option(1, "optimizer steps on each rollout's batch (mu)")
    steps: int = option(100, "rollouts to run (a resumed run continues up to it)")
