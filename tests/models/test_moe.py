"""The MoE feed-forward: routing against a per-token reference, capacity drops counted, closed-form counts,
the split-independent auxiliary loss, and the loss-free balancer correcting a biased router."""

import math

import pytest
import torch
import torch.nn.functional as F

from paralm.errors import UserError
from paralm.models.gpt2 import GPT
from paralm.models.loss import cross_entropy_loss
from paralm.models.moe import MoE, balance_figures, moe_layers, pop_auxiliary_loss, take_statistics, update_balance
from paralm.models.moe_config import check_moe
from paralm.models.registry import model_config, model_shape, model_spec


def _layer(gated: bool, **moe: object) -> MoE:
    torch.manual_seed(0)
    config = model_config(d_model=16, moe_experts=4, moe_top_k=2, **moe)
    layer = MoE(config, hidden=24, gated=gated)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _reference(layer: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: the top-k experts by score, weighted by their normalised scores (`keep`: which
    (token, choice) assignments survive capacity)."""
    e = layer.experts
    out = torch.zeros_like(x)
    for t, token in enumerate(x):
        scores = layer.gate(token).softmax(-1)
        top = scores.topk(layer.options.top_k).indices
        weights = scores[top] / scores[top].sum()
        for j, (expert, weight) in enumerate(zip(top.tolist(), weights, strict=True)):
            if keep is not None and not keep[t, j]:
                continue
            h = token @ e.w1[expert].t()
            h = F.silu(h) * (token @ e.w3[expert].t()) if e.gated else F.gelu(h)
            out[t] += weight * (h @ e.w2[expert].t())
    return out


@pytest.mark.parametrize("gated", [False, True])
def test_dropless_routing_matches_per_token_experts(gated: bool) -> None:
    layer = _layer(gated).train()
    x = torch.randn(2, 5, 16)
    got = layer(x)
    torch.testing.assert_close(got.view(-1, 16), _reference(layer, x.view(-1, 16)), atol=1e-5, rtol=1e-5)
    statistics = take_statistics(layer)
    assert statistics[1].item() == 0  # nothing dropped
    assert statistics[2:].sum().item() == 2 * 5 * 2  # every token reached top_k experts


def test_capacity_drops_overflow_in_token_order_and_counts_it() -> None:
    layer = _layer(False, moe_capacity=0.5).train()
    x = torch.randn(1, 8, 16)
    flat = x.view(-1, 16)
    capacity = math.ceil(0.5 * 8 * 2 / 4)
    chosen = layer.gate(flat).softmax(-1).topk(2).indices
    keep, seen = torch.zeros_like(chosen, dtype=torch.bool), [0] * 4
    for t in range(8):  # each expert takes the first `capacity` assignments in token order
        for j in range(2):
            expert = chosen[t, j].item()
            keep[t, j] = seen[expert] < capacity
            seen[expert] += 1
    got = layer(x)
    torch.testing.assert_close(got.view(-1, 16), _reference(layer, flat, keep), atol=1e-5, rtol=1e-5)
    dropped = int((~keep).sum())
    assert dropped > 0
    assert take_statistics(layer)[1].item() == dropped


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("every,shared", [(1, 0), (2, 2)])
def test_closed_form_counts_match_the_built_model(family: str, every: int, shared: int) -> None:
    config = model_config(
        family=family, n_layer=3, n_head=4, d_model=32, moe_experts=4, moe_top_k=2, moe_every=every,
        moe_shared_experts=shared,
    )  # fmt: skip
    model = model_spec(config).build(config)
    shape = model_shape(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    layers = moe_layers(model)
    assert len(layers) == (3 if every == 1 else 1)
    inactive = sum(layer.experts.w1.numel() + layer.experts.w2.numel() for layer in layers) // 2  # 2 of 4 experts
    if family == "llama":
        inactive += sum(layer.experts.w3.numel() for layer in layers) // 2
    assert shape.active_params == shape.params - inactive


def test_auxiliary_loss_does_not_depend_on_how_the_batch_is_split() -> None:
    """Per-sequence balance: the mean over halves of a batch is the whole batch's, so data-parallel ranks
    and micro-batches train what one process does."""
    layer = _layer(False, moe_aux_loss=0.1, moe_z_loss=0.01).train()
    x = torch.randn(4, 6, 16)
    layer(x)
    whole = pop_auxiliary_loss(layer)
    halves = []
    for part in x.split(2):
        layer(part)
        halves.append(pop_auxiliary_loss(layer))
    torch.testing.assert_close(whole, torch.stack(halves).mean())
    assert pop_auxiliary_loss(layer) is None  # taken once


def test_moe_settings_that_cannot_run_are_one_line_errors() -> None:
    with pytest.raises(UserError, match="moe_top_k"):
        check_moe(model_config(moe_experts=4, moe_top_k=5))
    with pytest.raises(UserError, match="moe_score"):
        check_moe(model_config(moe_experts=4, moe_score="relu"))
    with pytest.raises(UserError, match="moe_groups"):  # groups of one expert have no top-2 to rank them by
        check_moe(model_config(moe_experts=4, moe_groups=4))
    with pytest.raises(UserError, match="moe_topk_groups"):  # one group of 2 cannot hold top-3
        check_moe(model_config(moe_experts=4, moe_top_k=3, moe_groups=2, moe_topk_groups=1))


# DeepSeek's top-k methods on 6 experts in 3 groups of 2, router logits (A: 2, -3 | B: 1.5, 1.4 | C: -1, -1) for
# one token, top-2: greedy takes the 2 best experts (0, 2); by their best (DeepSeek-V2's group_limited_greedy) group
# A ranks first (2 > 1.5), by their two best (DeepSeek-V3's noaux_tc) B does (e^1.5 + e^1.4 > e^2 + e^-3 under
# softmax); a balancing bias of 3 on group C's experts makes V3 choose C, weighted by the scores without it.
LOGITS = [2.0, -3.0, 1.5, 1.4, -1.0, -1.0]
ROUTES = {  # name: (settings, chosen experts worked out by hand)
    "greedy": ({}, {0, 2}),
    "greedy-renorm": ({"moe_norm_topk": True}, {0, 2}),
    "group-max": ({"moe_groups": 3, "moe_group_score": "max"}, {0, 1}),
    "group-top2": ({"moe_groups": 3}, {2, 3}),
    "noaux-tc": ({"moe_groups": 3, "moe_score": "sigmoid", "moe_bias_balance": True}, {4, 5}),
    "noaux-tc-renorm": (
        {"moe_groups": 3, "moe_score": "sigmoid", "moe_bias_balance": True, "moe_norm_topk": True},
        {4, 5},
    ),
}


@pytest.mark.parametrize("name", list(ROUTES))
def test_each_top_k_method_routes_as_worked_out_by_hand(name: str) -> None:
    """Chosen experts as above; weights the chosen experts' scores (softmax over all 6, or sigmoid), divided by
    their sum with renormalisation only, times the routed scale."""
    settings, expected = ROUTES[name]
    options = {"moe_norm_topk": False, "moe_topk_groups": 1, "moe_routed_scale": 2.5} | settings
    layer = MoE(model_config(d_model=4, moe_experts=6, moe_top_k=2, **options), hidden=8, gated=True)
    with torch.no_grad():
        layer.gate.weight.zero_()[:, 0] = torch.tensor(LOGITS)
        layer.expert_bias[4:] = 3.0
    _, _, chosen, weights = layer.route(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert set(chosen[0].tolist()) == expected
    if settings.get("moe_score") == "sigmoid":
        scores = [1 / (1 + math.exp(-LOGITS[e])) for e in chosen[0].tolist()]
    else:
        scores = [math.exp(LOGITS[e]) / sum(math.exp(v) for v in LOGITS) for e in chosen[0].tolist()]
    if settings.get("moe_norm_topk"):
        scores = [v / sum(scores) for v in scores]
    torch.testing.assert_close(weights[0], 2.5 * torch.tensor(scores), rtol=1e-6, atol=0)


def test_shared_experts_are_one_mlp_as_wide_as_all_of_them() -> None:
    """moe_shared_experts = 2 (DeepSeek-V2-Lite's, Moonlight's): the layer adds two always-on SwiGLU experts, one
    MLP 2 x moe_hidden wide as DeepSeek stores them; its output is the routed one plus both experts' sum."""
    torch.manual_seed(0)
    config = model_config(d_model=16, moe_experts=4, moe_top_k=2, moe_shared_experts=2)
    layer, plain = MoE(config, hidden=24, gated=True), MoE(model_config(d_model=16, moe_experts=4), 24, True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared.")})
    x = torch.randn(2, 5, 16)
    shared = layer.shared
    assert shared.w1.shape == (1, 48, 16)
    each = [
        (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()
        for w1, w3, w2 in zip(shared.w1[0].chunk(2), shared.w3[0].chunk(2), shared.w2[0].chunk(2, dim=1), strict=True)
    ]
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain(x) + each[0] + each[1], atol=1e-5, rtol=1e-5)


BALANCE_STEPS = 50  # the figure docs/strategies.md states


def test_loss_free_balancer_evens_out_a_router_biased_to_one_expert() -> None:
    """Tiny config (2 layers, d_model 64, 4 experts, top-2), random tokens: each router starts sending every
    token to expert 0 (max/mean load about 2, the most top-2 allows); DeepSeek-V3's bias balancing (update
    rate 0.04, no auxiliary loss) brings max/mean to at most 1.3 within `BALANCE_STEPS` steps."""
    torch.manual_seed(0)
    config = model_config(
        n_layer=2, n_head=4, d_model=64, block_size=64, vocab_size=256, moe_experts=4, moe_top_k=2,
        moe_aux_loss=0.0, moe_bias_balance=True, moe_bias_rate=0.04,
    )  # fmt: skip
    model = GPT(config)
    towards = F.normalize(torch.randn(64), dim=0)
    with torch.no_grad():  # every normalised input leans along `towards`, which expert 0's router row favours
        for block in model.blocks.values():
            block.ln_2.bias += 2 * towards
            block.mlp.gate.weight[0] += 3 * towards
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 256, (4096,))
    imbalance = []
    for _ in range(BALANCE_STEPS + 1):
        starts = torch.randint(0, 4096 - 65, (4,)).tolist()
        x = torch.stack([data[s : s + 64] for s in starts])
        y = torch.stack([data[s + 1 : s + 65] for s in starts])
        cross_entropy_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        statistics = take_statistics(model)
        update_balance(model, statistics, (), torch.tensor(False))
        imbalance.append(balance_figures(statistics.tolist(), 1, 4)["moe_load_imbalance"])
    assert imbalance[0] > 1.8
    assert imbalance[-1] <= 1.3, imbalance
