"""The settings `paralm rl` cannot run, each refused in one line naming the field and the fix: the `[rl]`
section's ranges, and the layouts whose rollouts or losses are not built for RL.

Not part of `paralm.config.rules.validate`: a training run carries an unused `[rl]` section with an empty
`rl.prompts`; `paralm rl` applies `check_rl` to its config once loaded.
"""

from __future__ import annotations

import re

from paralm.config.rl import RLConfig
from paralm.config.schema import Config
from paralm.errors import UserError


def check_rl(config: Config) -> None:
    """Raise a `UserError` naming the field and the fix for the first `[rl]` setting or layout that cannot run."""
    rl = config.rl
    if not rl.prompts:
        raise UserError("rl.prompts is empty: set it to a JSONL or Parquet file or a datasets folder of prompts")
    ranges = (
        (
            "rl.group_size",
            rl.group_size,
            rl.group_size >= 2,
            "must be at least 2: a group is each completion's baseline",
        ),
        ("rl.prompts_per_step", rl.prompts_per_step, rl.prompts_per_step >= 1, "must be at least 1"),
        ("rl.max_new_tokens", rl.max_new_tokens, rl.max_new_tokens >= 1, "must be at least 1"),
        ("rl.temperature", rl.temperature, rl.temperature > 0, "must be positive (1.0 samples the model as it is)"),
        ("rl.top_p", rl.top_p, 0 < rl.top_p <= 1, "must be in (0, 1] (1.0 keeps every token)"),
        ("rl.clip_low", rl.clip_low, 0 <= rl.clip_low < 1, "must be in [0, 1): the ratio's floor is 1 - clip_low"),
        ("rl.clip_high", rl.clip_high, rl.clip_high >= 0, "must not be negative: the ratio's ceiling is 1 + it"),
        ("rl.kl_beta", rl.kl_beta, rl.kl_beta >= 0, "must not be negative (0: no reference model)"),
        ("rl.updates_per_rollout", rl.updates_per_rollout, rl.updates_per_rollout >= 1, "must be at least 1"),
        ("rl.steps", rl.steps, rl.steps >= 1, "must be at least 1"),
    )
    for name, value, holds, requirement in ranges:
        if not holds:
            raise UserError(f"{name} = {value} {requirement}")
    every = config.checkpoint.every
    if every and every % rl.updates_per_rollout:  # a resume re-samples its rollout: from the weights it sampled with
        raise UserError(
            f"checkpoint.every = {every} is not a multiple of rl.updates_per_rollout = {rl.updates_per_rollout}: "
            "save between rollouts (a multiple of it), so that a resumed run samples as the uninterrupted one did"
        )
    reward_weights(rl)
    if "format" in rl.rewards:
        format_regex(rl)
    _check_layout(config)


def reward_weights(rl: RLConfig) -> list[float]:
    """One weight per reward function: `rl.reward_weights`, or 1 each when it is empty."""
    if not rl.reward_weights:
        return [1.0] * len(rl.rewards)
    if len(rl.reward_weights) != len(rl.rewards):
        raise UserError(
            f"rl.reward_weights has {len(rl.reward_weights)} weights for {len(rl.rewards)} rl.rewards: "
            "give one per reward function, or none (1 each)"
        )
    return [float(w) for w in rl.reward_weights]


def format_regex(rl: RLConfig) -> re.Pattern:
    """`rl.format_pattern` compiled, or a one-line error saying why it does not compile."""
    try:
        return re.compile(rl.format_pattern)
    except re.error as e:
        raise UserError(
            f"rl.format_pattern = {rl.format_pattern!r} is not a regular expression ({e}): fix it"
        ) from None


def _check_layout(config: Config) -> None:
    """The layouts RL does not run: rollouts generate whole sequences on each rank, and the loss must stay
    the exact gradient of the global batch."""
    p, s, c = config.parallel, config.sync, config.comm
    refused = (
        (
            p.pp > 1,
            f"parallel.pp = {p.pp}: rollouts generate on whole models, not pipeline stages; set parallel.pp = 1",
        ),
        (
            p.cp > 1,
            f"parallel.cp = {p.cp}: rollouts decode with a whole KV cache per sequence, not context-parallel "
            "shards; set parallel.cp = 1",
        ),
        (
            s.mode != "allreduce",
            f"sync.mode = {s.mode}: the policy's update must be the exact gradient of the whole batch, which "
            "replicas stepping apart do not give; set sync.mode = allreduce",
        ),
        (
            c.compression != "none",
            f"comm.compression = {c.compression}: compressed gradients are not the exact policy gradient; set "
            "comm.compression = none",
        ),
        (
            s.fault_tolerant,
            "sync.fault_tolerant = true: replica groups share no rollout; set sync.fault_tolerant = false",
        ),
        (
            config.data.document_mask,
            "data.document_mask = true: rollouts are one prompt and completion a row, not packed documents; set "
            "data.document_mask = false",
        ),
    )
    for cannot, message in refused:
        if cannot:
            raise UserError(f"paralm rl does not run {message}")
