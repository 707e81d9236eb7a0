"""The step engine of `paralm rl`: the training loop's engine (`paralm.train.engine.StepEngine`), whose batches are
rollouts and whose step is the policy's update.

The trainer runs it unchanged: optimizer, schedule, checkpoints, metrics rows, stop signals and validation are the
training loop's. A rollout is sampled every `rl.updates_per_rollout` optimizer steps (`train.steps` counts those
steps: rollouts x updates); its prompts are a slice of a per-epoch shuffle of the prompt file, this rank's share of
it the data-parallel rank's. Rewards are scored on each rank for its completions and gathered, so that every rank
computes every group's advantage (and the batch's reward scale) alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paralm.config.schema import Config
from paralm.data.sampler import BatchLayout
from paralm.data.shards import read_meta
from paralm.data.tokenizer import load_tokenizer
from paralm.errors import UserError
from paralm.models.step import StepHook
from paralm.parallel.runtime import Runtime
from paralm.rl.objective import BatchCounts, advantages
from paralm.rl.policy_step import STATS, PolicyBatch, PolicyStep
from paralm.rl.prompts import Prompt, load_prompts
from paralm.rl.reference import Reference
from paralm.rl.rewards import Rewards, RewardScores
from paralm.rl.rollout import Colocated, Sampler, Sampling
from paralm.train.engine import StepEngine


def rollout_layout(config: Config, dp: int) -> BatchLayout:
    """How a rollout's completions split into micro-batches: each data-parallel rank's prompts' groups, in
    micro-batches of `train.micro_batch_size` completions."""
    rl, micro = config.rl, config.train.micro_batch_size
    if rl.prompts_per_step % dp:
        raise UserError(
            f"rl.prompts_per_step = {rl.prompts_per_step}: make it a multiple of the {dp} data-parallel ranks"
        )
    per_rank = rl.prompts_per_step // dp * rl.group_size
    micro = min(micro, per_rank)
    if per_rank % micro:
        raise UserError(
            f"train.micro_batch_size = {micro} does not divide the {per_rank} completions each data-parallel rank "
            f"updates on (rl.prompts_per_step / dp x rl.group_size): use a divisor of {per_rank}"
        )
    return BatchLayout(dp, per_rank // micro, micro)


class RolloutEngine(StepEngine):
    def __init__(self, config: Config, runtime: Runtime) -> None:
        super().__init__(config, runtime)
        rl = self.rl = config.rl
        data_dir = self.train_data.sources[0].path
        self.prompts = load_prompts(rl, data_dir, config.model.block_size)
        self.rewards = Rewards(rl)
        self.rewards.check_prompts(self.prompts)
        self.layout = rollout_layout(config, self.layout.dp_size)
        self.tokenizer = load_tokenizer(read_meta(data_dir)["tokenizer"], data_dir)
        self.sampling = Sampling(rl.max_new_tokens, rl.temperature, rl.top_p, stop_tokens(self.tokenizer, self.prompts))
        width = self.width = max(len(p.ids) for p in self.prompts) + rl.max_new_tokens  # one shape every rollout
        dtype = config.precision.dtype
        self.sampler: Sampler = Colocated(
            self.plan.model, rl.group_size, width, self.sampling, config.train.seed, dtype
        )
        self.policy = PolicyStep(self.module, self.device, dtype, runtime.dims.tp, rl, self.plan.runner)
        self.plan.runner = self.policy
        self.reference = Reference(config, runtime) if rl.kl_beta > 0 else None
        self.meter = RolloutMeter(runtime)
        self.hooks.append(self.meter)
        self.current: PolicyBatch | None = None
        self.current_rollout = -1

    @property
    def tokens_per_step(self) -> int:
        """The tokens an update runs forward and backward (its rows' tokens/s and MFU leave the rollout's out)."""
        return self.layout.global_batch * (self.width - 1)

    def prompts_of(self, rollout: int) -> list[tuple[int, Prompt]]:
        """The global batch's prompts of rollout `rollout` with their places in it: a slice of the epoch's shuffle."""
        n, per_step = len(self.prompts), self.rl.prompts_per_step
        orders: dict[int, torch.Tensor] = {}  # one shuffle per epoch the slice touches
        chosen = []
        for place in range(per_step):
            epoch, at = divmod(rollout * per_step + place, n)
            if epoch not in orders:
                seeded = torch.Generator().manual_seed(self.config.train.seed + epoch)
                orders[epoch] = torch.randperm(n, generator=seeded)
            chosen.append((place, self.prompts[int(orders[epoch][at])]))
        return chosen

    def step_batch(self, start: int = 0) -> PolicyBatch:
        """The batch of the optimizer step whose first sample is `start`: a new rollout every
        `rl.updates_per_rollout` steps, else the current one's again."""
        rollout = start // self.layout.global_batch // self.rl.updates_per_rollout
        if rollout != self.current_rollout:
            self.current, self.current_rollout = self.roll(rollout), rollout
        return self.current

    def roll(self, rollout: int) -> PolicyBatch:
        rl, layout = self.rl, self.layout
        started = time.perf_counter()
        per_rank = rl.prompts_per_step // layout.dp_size
        mine = self.prompts_of(rollout)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        prompts = [p for _, p in mine]
        rolled = self.sampler.sample([p.ids for p in prompts], [place for place, _ in mine], rollout)
        texts = [self.tokenizer.decode(t) for t in rolled.texts]
        scores = self.agreed(lambda: self.rewards.score([p for p in prompts for _ in range(rl.group_size)], texts))
        # every rank's completions' figures, in global order: rewards, each function's, correct, length
        columns = [scores.total, *scores.each.values(), rolled.lengths.float().cpu()]
        if scores.correct is not None:
            columns.append(scores.correct)
        table = self.gather(torch.stack([c.float().to(self.device) for c in columns], dim=1))
        rewards = table[:, 0].view(rl.prompts_per_step, rl.group_size)
        advantage = advantages(rewards, rl.scale_rewards).flatten()
        first = self.dp_rank * per_rank * rl.group_size
        mine_adv = advantage[first : first + per_rank * rl.group_size]
        counts = BatchCounts(len(advantage), int(table[:, len(scores.each) + 1].sum()), layout.dp_size)
        batch = self.policy_batch(rolled.tokens, rolled.completion, mine_adv, counts)
        sampled = time.perf_counter()
        if self.reference is not None:
            batch.ref_logp = self.policy.logprobs(self.reference.model, batch)
        referenced = time.perf_counter() if self.reference is not None else None
        if rl.updates_per_rollout > 1:  # the sampling policy's, kept for the later updates' ratios
            batch.old_logp = self.policy.logprobs(self.module, batch)
        self.meter.rolled(table, list(scores.each), scores.correct is not None, rl.max_new_tokens)
        self.meter.timed(sampled - started, referenced and referenced - sampled, counts.tokens)
        return batch

    def policy_batch(
        self, tokens: torch.Tensor, completion: torch.Tensor, adv: torch.Tensor, counts: BatchCounts
    ) -> PolicyBatch:
        batch = PolicyBatch(counts=counts)
        size = self.layout.micro_batch_size
        for first in range(0, tokens.shape[0], size):
            rows = slice(first, first + size)
            batch.micro_batches.append((tokens[rows, :-1], tokens[rows, 1:]))
            batch.completion.append(completion[rows])
            batch.advantages.append(adv[rows])
        return batch

    def agreed(self, score: Callable[[], RewardScores]) -> RewardScores:
        """`score()`, or on every rank the error of the first rank whose reward function failed: that rank must
        not leave the others waiting in the rewards' gather, and the job says one line, the failing function's."""
        error = None
        try:
            scores = score()
        except UserError as e:
            error = e
        if self.runtime.distributed:  # host metadata: on the gloo group of the ranks that step together
            messages: list[str | None] = [None] * dist.get_world_size(self.runtime.host_step_group)
            dist.all_gather_object(messages, None if error is None else str(error), group=self.runtime.host_step_group)
            failed = next((m for m in messages if m is not None), None)
            if failed is not None:
                raise UserError(failed)
        if error is not None:
            raise error
        return scores

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's rows of `local`, in rank order."""
        group = self.runtime.dp_group
        if group is None or dist.get_world_size(group) == 1:
            return local
        out = local.new_empty(dist.get_world_size(group) * local.shape[0], *local.shape[1:])
        dist.all_gather_into_tensor(out, local.contiguous(), group=group)
        return out

    def forward_backward(self, batch: PolicyBatch) -> torch.Tensor:
        started = time.perf_counter()
        loss = super().forward_backward(batch)
        self.meter.updated(batch.stats, time.perf_counter() - started, batch.counts)
        return loss


def stop_tokens(tokenizer: Any, prompts: list[Prompt]) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's end of text, where it has one, and a chat template's end
    of turn where prompts are conversations."""
    stops = {token for p in prompts for token in p.stop}
    return tuple(sorted(stops if tokenizer.eot_id is None else stops | {tokenizer.eot_id}))


class RolloutMeter(StepHook):
    """The rollout's figures for each step's metrics row: rewards, lengths, and the update's statistics
    averaged over the data-parallel ranks, and where the step's time went."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.values: dict[str, float] = {}

    def rolled(self, table: torch.Tensor, names: list[str], correct: bool, max_new_tokens: int) -> None:
        table = table.double().cpu()
        rewards, lengths = table[:, 0], table[:, len(names) + 1]
        self.values = {"reward_mean": rewards.mean().item(), "reward_std": rewards.std(correction=0).item()}
        self.values |= {f"reward/{name}": table[:, 1 + k].mean().item() for k, name in enumerate(names)}
        if correct:
            self.values["accuracy"] = table[:, -1].mean().item()
        self.values |= {
            "completion_len": lengths.mean().item(),
            "completion_len_max": lengths.max().item(),
            "truncated": (lengths >= max_new_tokens).double().mean().item(),
        }

    def timed(self, rollout_s: float, reference_s: float | None, tokens: int) -> None:
        self.values |= {"rollout_s": rollout_s, "rollout_tok_s": tokens / max(rollout_s, 1e-9)}
        if reference_s is not None:
            self.values |= {"reference_s": reference_s, "reference_tok_s": tokens / reference_s}

    def updated(self, stats: dict[str, torch.Tensor], seconds: float, counts: BatchCounts | None) -> None:
        shares = torch.stack([stats[name] for name in STATS]).double()
        if (group := self.runtime.dp_group) is not None:
            dist.all_reduce(shares, group=group)
        means = (shares / self.runtime.dims.dp).tolist()
        self.values |= dict(zip(STATS, means, strict=True))
        tokens = counts.tokens if counts else 0
        self.values |= {"update_s": seconds, "update_tok_s": tokens / max(seconds, 1e-9)}

    def ended(self, step: int, skipped: torch.Tensor) -> dict[str, Any]:
        return dict(self.values)
