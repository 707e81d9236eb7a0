"""The RL objective against the papers' formulas, written out here token by token with explicit loops:
DeepSeekMath 2024 eq. 3 (GRPO: clipped ratio, 1/|o_i| per sequence, group-std advantages) and eq. 4 (the k3 KL),
DAPO 2025 eq. 8 (one token-level mean over the batch, clip-higher), Dr. GRPO 2025 (a constant normaliser, no std),
and REINFORCE with a group baseline, whose gradient the loss must equal when mu = 1 and beta = 0.

Tolerances: the loops add the same fp32 terms in another order (rounding only, ~1e-7 relative): 1e-5 absolute.
"""

import math

import pytest
import torch

from paralm.config.rl import RLConfig
from paralm.rl.objective import BatchCounts, advantages, policy_loss, token_entropy

VOCAB, WIDTH, B, T = 11, 8, 6, 7
# completions start after a prompt of `start` tokens and have `length` tokens; the rest is padding (ragged)
SPANS = [(1, 4), (2, 5), (0, 7), (3, 1), (1, 2), (2, 3)]
CLOSE = dict(atol=1e-5, rtol=1e-5)


def _mask(spans=SPANS):
    mask = torch.zeros(len(spans), T)
    for i, (start, length) in enumerate(spans):
        mask[i, start : start + length] = 1
    return mask


def _inputs(seed=0):
    """Log-probabilities of a policy, an old policy ~30% away (so that some ratios leave [0.8, 1.2]) and a
    reference; garbage (huge differences) where the mask is 0, which the loss must ignore."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(torch.rand(B, T, generator=g) * 0.9 + 0.05)
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    ref = logp + 0.5 * torch.randn(B, T, generator=g)
    mask = _mask()
    old = torch.where(mask.bool(), old, -200.0)
    ref = torch.where(mask.bool(), ref, 200.0)
    adv = torch.randn(B, generator=g)
    return logp.requires_grad_(), old, ref, adv, mask


def _paper_loss(logp, old, ref, adv, mask, loss, clip_low, clip_high, beta, max_new_tokens):
    """-J of the paper, one token at a time."""
    total, lengths = 0.0, []
    for i in range(logp.shape[0]):
        seq, length = 0.0, 0
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            ratio = torch.exp(logp[i, t] - old[i, t])
            clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
            kl = torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1 if beta else 0.0
            seq = seq + torch.minimum(ratio * adv[i], clipped * adv[i]) - beta * kl
            length += 1
        total = total + (seq / length if loss == "grpo" else seq)
        lengths.append(length)
    normaliser = {"grpo": len(lengths), "dapo": sum(lengths), "dr_grpo": len(lengths) * max_new_tokens}[loss]
    return -total / normaliser


def _counts(mask, replicas=1):
    return BatchCounts(sequences=mask.shape[0], tokens=int(mask.sum()), replicas=replicas)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_each_normaliser_is_the_papers_formula(loss, beta):
    logp, old, ref, adv, mask = _inputs()
    rl = RLConfig(loss=loss, clip_low=0.2, clip_high=0.28, kl_beta=beta, max_new_tokens=T + 3)
    out = policy_loss(logp, old, adv, mask, rl, _counts(mask), ref_logp=ref)
    (grad,) = torch.autograd.grad(out.loss, logp)
    expected = _paper_loss(logp, old, ref, adv, mask, loss, 0.2, 0.28, beta, T + 3)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(out.loss, expected, **CLOSE)
    torch.testing.assert_close(grad, expected_grad, **CLOSE)
    assert grad[mask == 0].abs().max() == 0  # prompt and padding positions get no gradient
    assert 0 < out.clip_fraction < 1  # the inputs exercise both sides of the clip


def _model_logp(model, x, tokens):
    return torch.log_softmax(model(x), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _tiny_policy(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(WIDTH, VOCAB), torch.randn(B, T, WIDTH), torch.randint(VOCAB, (B, T))


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo"])
def test_the_shares_of_two_ranks_average_to_the_one_rank_loss_and_gradient(loss):
    """Ranks hold 2 and 4 sequences (9 and 13 tokens): each share is a local sum over the GLOBAL counts / 2, so even
    unequal shares (micro-batches, a ragged last batch) add up to the whole batch's loss."""
    model, x, tokens = _tiny_policy()
    _, old, ref, adv, mask = _inputs(seed=1)
    rl = RLConfig(loss=loss, clip_low=0.2, clip_high=0.28, kl_beta=0.1, max_new_tokens=T)
    params = list(model.parameters())

    def run(rows, replicas):
        out = policy_loss(
            _model_logp(model, x[rows], tokens[rows]), old[rows], adv[rows], mask[rows], rl,
            _counts(mask, replicas), ref_logp=ref[rows],
        )  # fmt: skip
        return out, torch.autograd.grad(out.loss, params)

    whole, whole_grads = run(slice(0, B), 1)
    shares = [run(slice(0, 2), 2), run(slice(2, B), 2)]
    assert mask[:2].sum() != mask[2:].sum()
    for field in ("loss", "clip_fraction", "kl"):
        torch.testing.assert_close(sum(getattr(s, field) for s, _ in shares) / 2, getattr(whole, field), **CLOSE)
    for k, grad in enumerate(whole_grads):
        torch.testing.assert_close((shares[0][1][k] + shares[1][1][k]) / 2, grad, **CLOSE)


def test_the_clip_stops_the_gradient_only_where_the_clipped_term_wins_and_clip_high_is_asymmetric():
    # sequence 0 has A = +1, sequence 1 A = -1; clip_low 0.2 -> [0.8, ...], clip_high 0.28 -> [..., 1.28]
    ratios = torch.tensor([[1.5, 1.25, 0.5, 1.0], [0.5, 0.75, 1.5, 0.9]])
    # A > 0 and ratio > 1.28: clipped; A < 0 and ratio < 0.8: clipped; every other token keeps ratio * A
    clipped = torch.tensor([[True, False, False, False], [True, True, False, False]])
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 4)
    logp = torch.zeros(2, 4, requires_grad=True)
    rl = RLConfig(loss="dapo", clip_low=0.2, clip_high=0.28)
    out = policy_loss(logp, -ratios.log(), adv, mask, rl, _counts(mask))
    (grad,) = torch.autograd.grad(out.loss, logp)
    # d/dlogp of -(ratio * A) / tokens = -ratio * A / tokens where the ratio's term wins
    torch.testing.assert_close(grad, torch.where(clipped, 0.0, -ratios * adv.unsqueeze(-1) / 8), **CLOSE)
    torch.testing.assert_close(out.clip_fraction, torch.tensor(3 / 8))
    symmetric = policy_loss(logp, -ratios.log(), adv, mask, RLConfig(loss="dapo"), _counts(mask))
    (grad,) = torch.autograd.grad(symmetric.loss, logp)
    assert grad[0, 1] == 0 and symmetric.clip_fraction == 4 / 8  # 1.25 > 1.2: clipped once clip_high is 0.2


def test_the_k3_kl_and_its_gradient_are_deepseekmaths_eq_4():
    logp, old, ref, _, mask = _inputs(seed=2)
    rl = RLConfig(loss="dapo", kl_beta=0.3)
    out = policy_loss(logp, old, torch.zeros(B), mask, rl, _counts(mask), ref_logp=ref)  # A = 0: only the KL
    (grad,) = torch.autograd.grad(out.loss, logp)
    value, expected_grad = 0.0, torch.zeros(B, T)
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                d = float(ref[i, t] - logp.detach()[i, t])
                value += math.exp(d) - d - 1
                expected_grad[i, t] = 0.3 * (1 - math.exp(d)) / mask.sum()  # d/dlogp of exp(d) - d - 1
    torch.testing.assert_close(out.kl, torch.tensor(value / float(mask.sum())), **CLOSE)
    torch.testing.assert_close(out.loss, torch.tensor(0.3 * value / float(mask.sum())), **CLOSE)
    torch.testing.assert_close(grad, expected_grad, **CLOSE)


def test_kl_beta_0_leaves_the_loss_alone_and_beta_without_a_reference_is_refused():
    logp, old, ref, adv, mask = _inputs()
    rl = RLConfig(loss="grpo", kl_beta=0.0)
    without = policy_loss(logp, old, adv, mask, rl, _counts(mask))
    with_ref = policy_loss(logp, old, adv, mask, rl, _counts(mask), ref_logp=ref)
    assert torch.equal(without.loss, with_ref.loss) and without.kl == 0 and with_ref.kl > 0  # kl: reported only
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, RLConfig(kl_beta=0.1), _counts(mask))


@pytest.mark.parametrize("loss, scale", [("dr_grpo", "none"), ("grpo", "group"), ("dapo", "group")])
def test_with_mu_1_and_no_kl_the_gradient_is_reinforce_with_a_group_baseline(loss, scale):
    """The update's gradient is -sum_i w_i A_i sum_t grad log pi(o_it), each sequence's term taken by autograd on
    its own log-probabilities: Dr. GRPO w = 1/(N L), A = r - mean; GRPO w = 1/(N |o_i|), A divided by the group's
    sample std + 1e-4; DAPO w = 1 / sum |o_i| with the same A."""
    model, x, tokens = _tiny_policy(seed=3)
    mask, group = _mask(), 3
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]])
    params = list(model.parameters())
    logp = _model_logp(model, x, tokens)
    rl = RLConfig(loss=loss, kl_beta=0.0, max_new_tokens=T)
    out = policy_loss(logp, logp.detach(), advantages(rewards, scale).flatten(), mask, rl, _counts(mask))
    grads = torch.autograd.grad(out.loss, params)

    expected = [torch.zeros_like(p) for p in params]
    for i in range(B):
        r = rewards.flatten()
        members = r[(i // group) * group : (i // group + 1) * group]
        mean = sum(members) / group
        a = r[i] - mean
        if scale == "group":
            a = a / (math.sqrt(sum((m - mean) ** 2 for m in members) / (group - 1)) + 1e-4)
        length = float(mask[i].sum())
        weight = {"dr_grpo": 1 / (B * T), "grpo": 1 / (B * length), "dapo": 1 / float(mask.sum())}[loss]
        seq_grads = torch.autograd.grad((_model_logp(model, x, tokens)[i] * mask[i]).sum(), params)
        for e, g in zip(expected, seq_grads, strict=True):
            e -= weight * a * g
    for grad, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, e, **CLOSE)


def test_advantages_center_on_the_group_and_scale_by_the_sample_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4], [2.0, 2.0, 2.0, 2.0]])
    flat = [float(r) for r in rewards.flatten()]
    batch_mean = sum(flat) / len(flat)
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in flat) / (len(flat) - 1))
    by_scale = {s: advantages(rewards, s) for s in ("group", "batch", "none")}
    for p, row in enumerate(rewards.tolist()):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1))
        for j, r in enumerate(row):
            assert by_scale["none"][p, j].item() == pytest.approx(r - mean, abs=1e-6)
            assert by_scale["group"][p, j].item() == pytest.approx((r - mean) / (std + 1e-4), abs=1e-5)
            assert by_scale["batch"][p, j].item() == pytest.approx((r - mean) / (batch_std + 1e-4), abs=1e-5)
    assert torch.equal(by_scale["group"][2], torch.zeros(4))  # all-equal group: 0, not NaN
    assert torch.equal(advantages(torch.ones(2, 3), "batch"), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="scale"):
        advantages(rewards, "std")


def test_token_entropy_is_minus_sum_p_log_p_in_fp32():
    logits = torch.randn(2, 3, VOCAB).to(torch.bfloat16)
    entropy = token_entropy(logits)
    assert entropy.dtype == torch.float32 and entropy.shape == (2, 3)
    for b in range(2):
        for t in range(3):
            z = sum(math.exp(float(v)) for v in logits[b, t])
            probs = [math.exp(float(v)) / z for v in logits[b, t]]
            assert entropy[b, t].item() == pytest.approx(-sum(p * math.log(p) for p in probs), abs=1e-5)
    uniform_but_one = torch.zeros(1, 1, VOCAB)
    uniform_but_one[..., 0] = -torch.inf  # a token that cannot be sampled adds 0, not NaN
    assert token_entropy(uniform_but_one).item() == pytest.approx(math.log(VOCAB - 1), abs=1e-6)
