"""The chunked loss equals the plain one, keeps no (tokens, vocab) tensor for backward, and computes its gradients
in forward, with plain's head matmuls: backward recomputes no logits.

Tolerance: fp32 throughout, the same sums in another order (per chunk, then added), so they differ by rounding
only (measured ~1e-7 relative on the loss, <= 4e-8 absolute on gradients ~1e-2): 1e-6 relative on the loss, 1e-6
absolute on each gradient entry.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

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
    assert chunked < logits_size / 4  # the weight's and the hidden states' gradients, not even one chunk's logits


class _HeadMatmuls(TorchDispatchMode):
    """Counts the matmuls run while it is active that have an operand `vocab` wide: the head's."""

    OPS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm}

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket in self.OPS and any(self.vocab in getattr(a, "shape", ()) for a in args):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _head_matmuls(loss_fn, vocab: int) -> tuple[int, int]:
    """The head's matmuls in `loss_fn()` (forward) and in its backward."""
    with _HeadMatmuls(vocab) as forward:
        loss = loss_fn()
    with _HeadMatmuls(vocab) as backward:
        if loss.requires_grad:
            loss.backward()
    return forward.count, backward.count


def test_the_chunked_head_costs_plains_matmuls_and_its_backward_recomputes_no_logits():
    """Forward computes each chunk's gradients with its loss: per chunk the logits, the hidden states' gradient and
    the weight's, plain's three; backward multiplies by no head at all. A frozen head skips the weight's gradient,
    and without autograd only the logits are computed."""
    hidden, weight, targets = _batch()
    vocab, chunks = weight.shape[0], 4
    plain_forward, plain_backward = _head_matmuls(lambda: cross_entropy_loss(F.linear(hidden, weight), targets), vocab)
    assert (plain_forward, plain_backward) == (1, 2)  # the harness sees autograd's matmuls too

    def chunked():
        return chunked_cross_entropy(hidden, weight, targets, chunks, torch.float32)

    assert _head_matmuls(chunked, vocab) == ((plain_forward + plain_backward) * chunks, 0)
    with torch.no_grad():
        assert _head_matmuls(chunked, vocab) == (chunks, 0)
    weight.requires_grad_(False)
    assert _head_matmuls(chunked, vocab) == (2 * chunks, 0)


def test_the_chunked_loss_compiles_into_one_graph_as_eager_computes_it():
    """`train.compile = model` traces the loss with the step: fullgraph fails on a graph break, aot_eager traces
    autograd's backward too; under no_grad the forward alone."""
    hidden, weight, targets = _batch()

    def loss(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(hidden, weight, targets, 3, torch.float32)

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    eager = torch.autograd.grad(loss(hidden, weight), (hidden, weight))
    for ours, theirs in zip(torch.autograd.grad(compiled(hidden, weight), (hidden, weight)), eager, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(hidden, weight), loss(hidden, weight), rtol=1e-6, atol=0)


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
