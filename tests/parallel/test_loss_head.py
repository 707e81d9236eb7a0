"""The chunked loss head trains as the plain one: one process (a tied head, a masked loss over several
micro-batches), tensor parallelism (vocabulary rows per rank, with and without sequence parallelism) and a
pipeline's last stage; and nowhere does it keep a (tokens, vocab) tensor for backward, which the plain one does.

Tolerances: fp32, the same sums in another order (per chunk; per rank then all-reduced), so rounding only:
1e-6 relative on the loss (measured: equal, or 1 ulp of ln(4096) = 8.3), 1e-6 absolute on every gradient entry
(measured <= 6e-8).
"""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from paralm.config.schema import TrainConfig
from paralm.errors import UserError
from paralm.models.loss import IGNORE_INDEX, cross_entropy_loss
from paralm.models.registry import FAMILIES, model_config
from paralm.models.step import StepBatch
from paralm.parallel.loss_head import ChunkedHead, PlainHead, build_loss_head, loss_impl
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.parallel.step import PlainStep
from tests.helpers import runtime_for, tiny_config
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import merged, one_step

VOCAB = 4096  # the logits (tokens x vocab) outweigh every weight and activation of the tiny model
CHUNKED = {"loss_impl": "chunked", "loss_chunks": 4}
PLAIN = {"loss_impl": "plain"}  # the reference (the default is auto: chunked on a CPU)


def assert_same_gradients(reference: dict[str, torch.Tensor], chunked: dict[str, torch.Tensor]) -> None:
    assert reference.keys() == chunked.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(chunked[name], grad, rtol=0, atol=1e-6, msg=name)


class SavedSizes:
    """The most elements any tensor autograd saves for backward has, while entered."""

    def __init__(self) -> None:
        self.largest = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.largest = max(self.largest, tensor.numel())
        return tensor

    def __enter__(self) -> "SavedSizes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def test_fused_is_refused_in_one_line_where_it_cannot_run_and_auto_then_chunks():
    with pytest.raises(UserError, match="train.loss_impl = fused .* CUDA GPU .* use train.loss_impl = chunked"):
        loss_impl("fused", "cpu", 1)
    assert loss_impl("auto", "cpu", 1) == "chunked"
    assert loss_impl("plain", "cpu", 2) == "plain"


def _step(model: nn.Module, head, batch: StepBatch) -> tuple[float, dict[str, torch.Tensor], int]:
    model.zero_grad(set_to_none=True)
    with SavedSizes() as saved:
        loss = PlainStep(model, torch.device("cpu"), "fp32", head=head).forward_backward(batch, lambda loss: loss)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved.largest


def test_a_tied_model_steps_alike_through_the_chunked_head_with_a_masked_loss():
    torch.manual_seed(0)
    config = model_config("gpt2", n_layer=2, n_head=2, d_model=32, block_size=32, vocab_size=VOCAB, dropout=0.0)
    model = FAMILIES["gpt2"].build(config)
    assert model.lm_head.weight is model.wte.weight
    g = torch.Generator().manual_seed(1)
    micro_batches = []
    for _ in range(2):
        x, y = torch.randint(0, VOCAB, (2, 2, 32), generator=g)
        micro_batches.append((x, y.masked_fill(torch.rand(y.shape, generator=g) < 0.4, IGNORE_INDEX)))
    batch = StepBatch(micro_batches, loss_tokens=float(sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)))
    head = build_loss_head(TrainConfig(**CHUNKED), "fp32", torch.device("cpu"), 1, model.lm_head)
    assert isinstance(head, ChunkedHead)
    plain_loss, plain_grads, plain_saved = _step(model, PlainHead(), batch)
    loss, grads, saved = _step(model, head, batch)
    assert abs(loss - plain_loss) <= 1e-6 * plain_loss
    assert_same_gradients(plain_grads, grads)  # the tied weight's: the head's and the embedding's parts
    logits = 2 * 32 * VOCAB  # one micro-batch's
    assert plain_saved >= logits > saved


def _watch_saved(trainer):
    saved = SavedSizes().__enter__()

    def observed() -> int:
        saved.__exit__(None, None, None)
        return saved.largest

    return observed


def _one_steps(configs, masked_check: bool) -> list[tuple]:
    """Each config's first step (loss, gradients, largest saved tensor) on one process group; first, with
    `masked_check`, a masked loss through a vocabulary-parallel chunked head against the whole head's."""
    runtime = init_runtime(configs[0].parallel, configs[0].sync)
    results = [_vocabulary_parallel_masked(runtime.mesh["tp"])] if masked_check else []
    results += [one_step(config, runtime_for(config, runtime), _watch_saved) for config in configs]
    shutdown(runtime)
    return results


def _vocabulary_parallel_masked(mesh) -> tuple[float, float, float]:
    """|loss - plain| / plain, and the largest differences of the hidden states' and the weight's gradients."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 20, 8, generator=g, requires_grad=True)
    head = nn.Linear(8, 64, bias=False)
    head.weight = nn.Parameter(torch.randn(64, 8, generator=g))
    targets = torch.randint(0, 64, (3, 20), generator=g).masked_fill(torch.rand(3, 20, generator=g) < 0.4, -100)
    plain = cross_entropy_loss(head(hidden), targets, 31.0)
    plain_grads = torch.autograd.grad(plain, (hidden, head.weight))
    head.weight = nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))
    loss = ChunkedHead(head, 3, torch.float32)(hidden, targets, 31.0)
    grads = torch.autograd.grad(loss, (hidden, head.weight))
    return (
        abs(loss.item() - plain.item()) / plain.item(),
        (grads[0] - plain_grads[0]).abs().max().item(),
        (grads[1].full_tensor() - plain_grads[1]).abs().max().item(),
    )


@pytest.mark.slow
def test_tensor_parallel_chunked_head_matches_the_plain_one(tmp_path):
    configs = [
        tiny_config(tmp_path / name, model={"vocab_size": VOCAB}, parallel={"tp": 2, "sequence_parallel": sp}, train=t)
        for name, sp, t in (("plain", False, PLAIN), ("chunked", False, CHUNKED), ("chunked_sp", True, CHUNKED))
    ]
    for masked, (plain_loss, plain_grads, plain_saved), *chunked in run_ranks(_one_steps, 2, tmp_path, configs, True):
        assert max(masked) <= 1e-6, masked
        logits = 4 * 32 * VOCAB // 2  # one micro-batch's, on one rank
        assert plain_saved >= logits
        for loss, grads, saved in chunked:
            assert abs(loss - plain_loss) <= 1e-6 * plain_loss
            assert_same_gradients(plain_grads, grads)
            assert saved < logits


@pytest.mark.slow
def test_a_pipelines_last_stage_chunked_head_matches_the_plain_one(tmp_path):
    configs = [
        tiny_config(tmp_path / name, model={"vocab_size": VOCAB}, parallel={"pp": 2, "pp_microbatches": 2}, train=t)
        for name, t in (("plain", PLAIN), ("chunked", CHUNKED))
    ]
    first, last = run_ranks(_one_steps, 2, tmp_path, configs, False)
    (plain_loss, _, plain_saved), (loss, _, saved) = last  # the loss is the last stage's
    assert abs(loss - plain_loss) <= 1e-6 * plain_loss
    assert_same_gradients(*(merged([first[i][1], last[i][1]]) for i in (0, 1)))
    logits = 2 * 32 * VOCAB  # one pipeline micro-batch's
    assert plain_saved >= logits > saved
