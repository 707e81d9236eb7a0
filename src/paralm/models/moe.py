"""A mixture-of-experts feed-forward for any family: a router sends each token to `moe_top_k` of
`moe_experts` expert MLPs (a family picks their kind: GPT-2's GELU MLP, Llama's SwiGLU).

The layer knows nothing about ranks. Routed tokens reach the experts sorted by expert, with the count
per expert, so expert parallelism (`paralm.parallel.expert`) only has to wrap `MoE.experts`: it sends
each expert's tokens to the rank holding it and brings the outputs back.

Balance, three ways, each optional:
- an auxiliary loss (Switch/GShard: E * sum_e f_e P_e, 1 when balanced), computed per sequence and
  averaged over sequences (DeepSeek-V3's sequence-wise form), so its value and gradient do not depend
  on how a batch is split over ranks and micro-batches;
- loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing experts only,
  moved after each step towards the under-loaded experts (`update_balance`, outside autograd);
- a router z-loss (ST-MoE) keeping the router's logits small.
Routing is dropless unless `moe_capacity` > 0: then each expert takes at most capacity x T x k / E of
a micro-batch's T tokens, and the rest are dropped (they pass through the residual) and counted.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from paralm.models.config import ModelConfig
from paralm.models.moe_config import MoEConfig, is_moe_block, moe_options, moe_slots

RESIDUAL = ("experts.w2", "shared.w2")  # output projections: the families scale their initial std


_recomputing = [False]  # a block's forward replayed by activation checkpointing (one process, one flag)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Activation checkpointing's recomputation context: a replayed forward routes as the first one (same
    inputs, same bias) and builds the same graph, but keeps no auxiliary loss and counts no statistics,
    which the first forward already did."""
    _recomputing[0] = True
    try:
        yield
    finally:
        _recomputing[0] = False


def local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (expert parallelism makes it a DTensor sharded by expert)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class GroupedExperts(nn.Module):
    """`num` MLPs with weights stacked on a leading expert dimension: `gated` SwiGLU (w2(silu(w1 x) *
    w3 x)), else GELU (w2(gelu(w1 x))). Takes tokens sorted by expert and the count of each (None: every
    token to the only expert)."""

    def __init__(self, num: int, d_model: int, hidden: int, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        self.w1 = nn.Parameter(torch.empty(num, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(num, d_model, hidden))
        self.w3 = nn.Parameter(torch.empty(num, hidden, d_model)) if gated else None

    def forward(self, x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        weights = [local(w) for w in (self.w1, self.w2, self.w3) if w is not None]
        if torch.is_autocast_enabled(x.device.type):  # the grouped kernel is not on autocast's lists
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), [w.to(dtype) for w in weights]
        matmul = _expert_matmul(x, weights, counts)
        h = matmul(x, weights[0])
        h = F.silu(h) * matmul(x, weights[2]) if self.gated else F.gelu(h)
        return matmul(h, weights[1])


def grouped_kernel_takes(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` runs on these operands: rows of whole 16-byte units, and bf16 (on CUDA from
    SM 8.0, as its docs state) or any float on a CPU outside `torch.compile` (the eager CPU kernel takes fp32;
    the compiled form's meta function wants bf16)."""
    if any(w.shape[-1] * w.element_size() % 16 or w.shape[-2] * w.element_size() % 16 for w in weights):
        return False
    if x.device.type == "cpu":
        return x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    return x.dtype == torch.bfloat16 and x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 0)


def _expert_matmul(
    x: torch.Tensor, weights: list[torch.Tensor], counts: torch.Tensor | None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """rows, (experts, out, in) -> each expert's rows times its matrix. With the grouped kernel the counts
    stay on the device (group ends, int32); where it does not run (`grouped_kernel_takes`) they are read on
    the host."""
    if counts is None:
        return lambda rows, weight: rows @ weight[0].t()
    if grouped_kernel_takes(x, *weights):
        ends = counts.cumsum(0, dtype=torch.int32)
        return lambda rows, weight: F.grouped_mm(rows, weight.transpose(-2, -1), offs=ends)
    sizes = counts.tolist()
    return lambda rows, weight: torch.cat([c @ w.t() for c, w in zip(rows.split(sizes), weight, strict=True)])


class MoE(nn.Module):
    """Router, routed experts and an optional shared expert. In training, each forward keeps its
    auxiliary loss (`pop_auxiliary_loss`) and adds to the step's routing statistics (`take_statistics`)."""

    def __init__(self, config: ModelConfig, hidden: int, gated: bool, layer: int = 0) -> None:
        super().__init__()
        self.options: MoEConfig = moe_options(config)
        self.slot = sum(is_moe_block(config, i) for i in range(layer))  # its place among the model's MoE layers
        self.layers = moe_slots(config)  # the model's MoE layers, which `take_statistics` lays out
        experts, d = self.options.experts, config.d_model
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = GroupedExperts(experts, d, hidden, gated)
        # n shared experts as one MLP n times as wide: the same sum, as DeepSeek's released weights store them
        shared = self.options.shared_experts
        self.shared = GroupedExperts(1, d, hidden * shared, gated) if shared else None
        self.register_buffer("expert_bias", torch.zeros(experts))  # loss-free balancing; saved in checkpoints
        # Per-sequence means the balance terms read; where a layer routes part of each sequence (sequence or
        # context parallelism), the parallel code completes them over the ranks holding the other parts
        self.sequence_mean = nn.Identity()
        self.position_groups: list[dist.ProcessGroup] = []  # those ranks, marked by the parallel code
        self.dropout = nn.Dropout(config.dropout)
        self.aux_loss: torch.Tensor | None = None
        self.load: torch.Tensor | None = None  # tokens routed to each expert this step (before drops)
        self.dropped: torch.Tensor | None = None
        self.balance: torch.Tensor | None = None  # the balance loss (1: balanced), summed over forwards
        self.forwards = 0

    @property
    def token_wise(self) -> bool:
        """Whether each token's route is its own: no capacity, which would drop tokens by their order in
        the micro-batch. Such a layer can route any part of a sequence apart from the rest."""
        return self.options.capacity <= 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, scores, chosen experts (T, k), their weights (T, k)) for tokens `x` (T, d)."""
        c = self.options
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if c.score == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if c.bias_balance else scores
        if c.groups > 1:
            choice = self._best_groups(choice)
        chosen = choice.topk(c.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if c.norm_topk and (c.top_k > 1 or c.score == "sigmoid"):  # Mixtral's, DeepSeek-V3's
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, scores, chosen, weights * c.routed_scale

    def _best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: experts outside each token's `moe_topk_groups` groups set to -inf, the groups
        ranked by the sum of their two best choice scores (`top2`, DeepSeek-V3) or by their best (`max`, V2)."""
        c = self.options
        grouped = choice.view(choice.shape[0], c.groups, -1)
        ranks = grouped.amax(-1) if c.group_score == "max" else grouped.topk(2, dim=-1).values.sum(-1)
        best = ranks.topk(c.topk_groups, dim=-1).indices
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        c, k = self.options, self.options.top_k
        flat = x.reshape(-1, d)
        logits, scores, chosen, weights = self.route(flat)
        assigned = chosen.flatten()
        order = assigned.argsort(stable=True)  # assignments sorted by expert, tokens in order within one
        # tokens per expert; bincount's shape would depend on the data, which torch.compile cannot trace
        counts = assigned.new_zeros(c.experts).index_add_(0, assigned, torch.ones_like(assigned))
        kept = counts
        if c.capacity > 0:
            capacity = math.ceil(c.capacity * flat.shape[0] * k / c.experts)
            first = counts.cumsum(0) - counts
            place = torch.arange(order.numel(), device=x.device) - first[assigned[order]]
            order, kept = order[place < capacity], counts.clamp(max=capacity)
        token = order // k
        routed = self.experts(flat[token], kept) * weights.flatten()[order, None].to(flat.dtype)
        out = torch.zeros_like(flat).index_add_(0, token, routed)
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.training:
            self._account(logits, scores, chosen, counts, kept, batch)
        return self.dropout(out.view(batch, seq, d))

    def _account(
        self,
        logits: torch.Tensor,
        scores: torch.Tensor,
        chosen: torch.Tensor,
        counts: torch.Tensor,
        kept: torch.Tensor,
        batch: int,
    ) -> None:
        """The auxiliary loss of this forward, and its routing added to the step's statistics (on the device)."""
        c, experts = self.options, self.options.experts
        probs = scores if c.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        share = probs.view(batch, -1, experts).mean(1)  # P: mean score per sequence and expert
        picks = chosen.view(batch, -1)
        routed = torch.zeros(batch, experts, device=picks.device).scatter_add_(1, picks, torch.ones_like(picks).float())
        z = torch.logsumexp(logits, -1).square().view(batch, -1).mean(1, keepdim=True)
        means = self.sequence_mean(torch.cat([share, routed / picks.shape[1], z], dim=1))
        share, routed_share, z = means.split([experts, experts, 1], dim=1)  # f: the share of picks per expert
        balance = experts * (routed_share * share).sum(-1).mean()
        aux = c.aux_loss * balance + c.z_loss * z.mean()
        if _recomputing[0]:
            return
        self.aux_loss = aux if c.aux_loss or c.z_loss else None
        with torch.no_grad():
            if self.load is None:
                self.load = torch.zeros(experts, device=counts.device)
                self.dropped = torch.zeros((), device=counts.device)
                self.balance = torch.zeros((), device=counts.device)
            self.load += counts
            self.dropped += (counts - kept).sum()
            self.balance += balance.detach()
            self.forwards += 1


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def expert_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes of the routed experts' weights: this rank's share (`expert_bytes_per_rank`) and the whole's."""
    weights = [p for layer in moe_layers(module) for p in layer.experts.parameters()]
    return {
        "expert_bytes_per_rank": sum(local(p).numel() * p.element_size() for p in weights),
        "expert_bytes_total": sum(p.numel() * p.element_size() for p in weights),
    }


def pop_auxiliary_loss(module: nn.Module) -> torch.Tensor | None:
    """The auxiliary losses of the MoE layers' last forward, summed (None without any); each is taken once."""
    losses = []
    for layer in moe_layers(module):
        if layer.aux_loss is not None:
            losses.append(layer.aux_loss)
            layer.aux_loss = None
    return torch.stack(losses).sum() if losses else None


def take_statistics(module: nn.Module) -> torch.Tensor | None:
    """This step's routing of this rank, as sums over ranks make sense of (see `balance_figures`):
    [balance loss mean over forwards, summed over layers, dropped tokens, tokens per expert of each MoE
    layer of the whole model...], zeros for the layers a pipeline stage does not hold (so ranks holding
    other stages add theirs in place); the statistics start again. None without MoE layers that ran."""
    layers = [layer for layer in moe_layers(module) if layer.forwards]
    if not layers:
        return None
    loads = torch.zeros(layers[0].layers, layers[0].options.experts, device=layers[0].load.device)
    for layer in layers:
        loads[layer.slot] = layer.load
    balance = torch.stack([layer.balance / layer.forwards for layer in layers]).sum()
    dropped = torch.stack([layer.dropped for layer in layers]).sum()
    values = torch.cat([balance.view(1), dropped.view(1), loads.flatten()])
    for layer in layers:
        layer.load = layer.dropped = layer.balance = None
        layer.forwards = 0
    return values


def balance_figures(summed: list[float], replicas: int, experts: int, tp: int = 1) -> dict[str, float]:
    """Metrics of `take_statistics`' vectors summed over ranks (`replicas`: the ranks holding each balance
    loss, data-parallel times tensor-parallel): the balance loss (mean), dropped tokens, and the worst
    layer's max/mean tokens per expert. Tokens are dropped only by a capacity, and a layer with one routes
    the gathered tokens on each of the `tp` ranks alike (not `token_wise`): each drop is counted tp times."""
    loads = torch.tensor(summed[2:]).view(-1, experts)
    imbalance = (loads.amax(1) / loads.mean(1).clamp(min=1e-9)).max().item()
    return {
        "moe_aux_loss": summed[0] / replicas / loads.shape[0],  # the mean over the layers
        "moe_dropped_tokens": round(summed[1] / tp),
        "moe_load_imbalance": imbalance,
    }


def routing_groups(module: nn.Module, dp_group: dist.ProcessGroup | None) -> list[dist.ProcessGroup]:
    """The ranks routing the step's other tokens, over which its tokens per expert sum: the data-parallel
    group, and the groups each MoE layer routing part of every sequence shares the rest with (`position_groups`:
    the tp ranks under sequence parallelism, the cp ranks)."""
    groups = [dp_group] if dp_group is not None else []
    for layer in moe_layers(module):
        groups.extend(group for group in layer.position_groups if group not in groups)
    return groups


@torch.no_grad()
def update_balance(
    module: nn.Module, statistics: torch.Tensor, groups: Sequence[dist.ProcessGroup], skipped: torch.Tensor
) -> None:
    """Loss-free balancing, after a step: each layer's bias moves by `moe_bias_rate` towards its
    under-loaded experts, by the tokens per expert of the whole step (`statistics` of
    `take_statistics`, this rank's, summed here over each of `groups`: the ranks routing other tokens);
    a skipped step moves nothing."""
    layers = moe_layers(module)
    if not layers or not layers[0].options.bias_balance:
        return
    loads = statistics[2:].clone()
    for group in groups:
        dist.all_reduce(loads, group=group)
    loads = loads.view(-1, layers[0].options.experts)
    for layer in layers:
        load = loads[layer.slot]
        step = layer.options.bias_rate * torch.sign(load.mean() - load)
        layer.expert_bias += step * (~skipped).to(step.dtype)
