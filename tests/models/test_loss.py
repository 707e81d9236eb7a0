"""The chunked loss equals the plain one, and keeps no (tokens, vocab) tensor for backward.

Tolerance: fp32 throughout, the same sums in another order (per chunk, then added), so they differ by rounding
only (measured ~1e-7 relative on the loss, <= 4e-8 absolute on gradients ~1e-2): 1e-6 relative on the loss, 1e-6
absolute on each gradient entry.
"""

import pytest
import torch
import torch.nn.functional as F

from paralm.models.loss import IGNORE_INDEX, chunked_cross_entropy, cross_entropy_loss
from paralm.models.registry import FAMILIES, model_config


def _batch(vocab: int = 300, d_model: int = 16, tokens: int = 61):
    """Hidden states (2, tokens, d_model), a head weight and targets, a third of them ignored (a loss mask)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, tokens, d_model, generator=g, requires_grad=True)
    weight = (0.2 * torch.randn(vocab, d_model, generator=g)).requires_grad_()
    targets = torch.randint(0, vocab, (2, tokens), generator=g)
    targets[torch.rand(2, tokens, generator=g) < 1 / 3] = IGNORE_INDEX
    return hidden, weight, targets


def _largest_saved(loss_fn) -> tuple[torch.Tensor, int]:
    """The loss `loss_fn()` returns, and the most elements any tensor autograd saved for its backward has."""
    sizes = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_fn()
    return loss, max(sizes)


@pytest.mark.parametrize("tokens", [None, 57.0])  # the mean over the trained targets; a global-batch count
def test_chunked_loss_and_gradients_equal_the_plain_ones_with_a_mask(tokens):
    hidden, weight, targets = _batch()
    plain = cross_entropy_loss(F.linear(hidden, weight), targets, tokens)
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    for chunks in (1, 5, 200):  # whole, uneven slices (122 tokens), more chunks than tokens
        chunked = chunked_cross_entropy(hidden, weight, targets, chunks, torch.float32, tokens)
        torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0, msg=f"{chunks} chunks")
        for ours, theirs in zip(torch.autograd.grad(chunked, (hidden, weight)), plain_grads, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_chunked_loss_saves_no_logits_for_backward():
    hidden, weight, targets = _batch(vocab=1000)
    logits_size = targets.numel() * 1000
    _, plain = _largest_saved(lambda: cross_entropy_loss(F.linear(hidden, weight), targets))
    _, chunked = _largest_saved(lambda: chunked_cross_entropy(hidden, weight, targets, 4, torch.float32))
    assert plain >= logits_size  # what would be saved: the logits (or their log-softmax)
    assert chunked < logits_size / 4  # the head weight and the hidden states, not even one chunk's logits


def test_a_frozen_head_gets_no_gradient():
    """LoRA freezes the head: backward then computes only the hidden states' gradient."""
    hidden, weight, targets = _batch()
    weight.requires_grad_(False)
    chunked_cross_entropy(hidden, weight, targets, 3, torch.float32).backward()
    assert hidden.grad is not None and weight.grad is None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_familys_hidden_states_times_its_head_are_its_logits(family):
    """What a chunked loss multiplies: the final norm's output (`hidden=True`) by the spec's head weight."""
    torch.manual_seed(0)
    spec = FAMILIES[family]
    config = model_config(family, n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=50)
    model = spec.build(config).eval()
    x = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        hidden = model(x, hidden=True)
        assert hidden.shape == (2, 8, 16)
        torch.testing.assert_close(F.linear(hidden, model.get_submodule(spec.head).weight), model(x))
