"""Validation loss: every data-parallel rank runs the same number of forwards (under ZeRO-3 each one is a
collective), however its windows fall, and the loss is one process's mean over the trained targets.

Tolerances: the ranks add the same per-window losses grouped in other batches, fp32 rounding only (about
1e-7 on losses near 5.7): 1e-6 relative.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from paralm.data.sampler import sample_windows
from paralm.data.shards import IGNORE, TokenDataset
from paralm.parallel.context.layout import SequenceShard
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.engine import StepEngine
from paralm.train.validation import EVAL_SEED_OFFSET, validation_loss
from tests.chat_helpers import chat_dataset
from tests.helpers import tiny_config
from tests.multiprocess import run_ranks

SEED, WIDTH, VOCAB = 7, 4, 16


class _Windows:
    """A dataset of `WIDTH`-token windows; the targets of the windows in `untrained` are all `IGNORE` (chat
    data whose window holds no assistant token)."""

    num_windows = 10_000

    def __init__(self, untrained: set[int]) -> None:
        self.untrained = untrained

    def batch(self, windows):
        x = torch.tensor([[(w + i) % VOCAB for i in range(WIDTH)] for w in windows])
        y = (x * 3 + 1) % VOCAB
        y[[w in self.untrained for w in windows]] = IGNORE
        return x, y


def _scorer(forwards: list[int]):
    """A batch's mean cross-entropy over its trained targets under a fixed logits table, counting its calls."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))

    def score(x, y, documents):
        forwards.append(len(x))
        return F.cross_entropy(table[x].flatten(0, 1), y.flatten())

    return score


def _ranks_loss(dataset, dp: int, samples: int, micro_batch_size: int) -> tuple[list[int], float, int]:
    """Each of `dp` ranks' forward count, and the loss and tokens of their sums added as the all-reduce would."""
    counts, totals = [], []
    for rank in range(dp):
        forwards: list[int] = []
        dims = SimpleNamespace(dp=dp, tp=1, cp=1)
        runtime = SimpleNamespace(dims=dims, dp_rank=rank, all_reduce=totals.append)
        model, score = torch.nn.Linear(1, 1), _scorer(forwards)
        validation_loss(model, score, dataset, runtime, samples, micro_batch_size, SEED, torch.device("cpu"))
        counts.append(len(forwards))
    total = torch.stack(totals).sum(0)
    return counts, (total[0] / total[1]).item(), int(total[1])


@pytest.mark.parametrize(
    "dp, samples, micro_batch_size, untrained",
    [(2, 8, 1, [1]), (2, 9, 4, []), (3, 2, 1, []), (2, 12, 2, [0, 2])],
    ids=["untrained-window-on-one-rank", "samples-not-a-multiple-of-dp", "a-rank-without-windows", "untrained-batch"],
)
def test_every_rank_runs_the_same_forwards_and_the_loss_is_one_processs(dp, samples, micro_batch_size, untrained):
    windows = sample_windows(SEED + EVAL_SEED_OFFSET, 0, samples, _Windows.num_windows)
    assert len(set(windows.tolist())) == samples  # each window once: marking one marks one sample
    dataset = _Windows({int(windows[i]) for i in untrained})
    model, score = torch.nn.Linear(1, 1), _scorer([])
    one, one_tokens = validation_loss(model, score, dataset, None, samples, micro_batch_size, SEED, torch.device("cpu"))
    counts, loss, tokens = _ranks_loss(dataset, dp, samples, micro_batch_size)
    assert len(set(counts)) == 1, f"forwards per rank {counts}"
    assert tokens == one_tokens == WIDTH * (samples - len(untrained))
    assert loss == pytest.approx(one, rel=1e-6)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return chat_dataset(tmp_path_factory.mktemp("sft"))


# (eval_samples, micro_batch_size): the 11th window trains no token, so rank 0 has one batch fewer to score
# than rank 1; 9 windows over 2 ranks in batches of 4 leave rank 0 two batches and rank 1 one
CASES = [(12, 1), (9, 4)]


def _validation_losses(config) -> list[tuple[float, int]]:
    runtime = init_runtime(config.parallel, config.sync)
    engine = StepEngine(config, runtime)
    t = config.train
    dataset = engine.val_data.datasets[0]
    losses = [
        validation_loss(engine.module, engine.plan.eval_loss, dataset, runtime, samples, size, t.seed, engine.device)
        for samples, size in CASES
    ]
    shutdown(runtime)
    return losses


def _config(chat_data, run_dir, parallel: dict | None = None):
    return tiny_config(run_dir, model={"vocab_size": 300}, data={"path": str(chat_data)}, parallel=parallel or {})


def _ranks_and_one(chat_data, tmp_path, parallel: dict) -> tuple[list, list]:
    """(loss, tokens) for each of CASES on 2 ranks under `parallel` (the same on both), and on one process."""
    ranks = run_ranks(_validation_losses, 2, tmp_path, _config(chat_data, tmp_path / "ranks", parallel))
    assert ranks[0] == ranks[1]
    return ranks[0], _validation_losses(_config(chat_data, tmp_path / "one"))


def _targets(chat_data, samples: int) -> torch.Tensor:
    """The targets of the first `samples` validation windows."""
    config = _config(chat_data, "unused")
    dataset = TokenDataset(chat_data, "val", config.model.block_size)
    return dataset.batch(sample_windows(config.train.seed + EVAL_SEED_OFFSET, 0, samples, dataset.num_windows))[1]


@pytest.mark.slow
def test_zero3_validation_finishes_with_one_processs_loss(chat_data, tmp_path):
    """2 ZeRO-3 ranks, whose forwards all-gather the parameters, on chat data; a rank that ran fewer forwards
    would leave the other waiting until `parallel.timeout_s`."""
    assert (_targets(chat_data, 12) != IGNORE).sum(1)[10] == 0  # the window the chat case is about
    ranks, one = _ranks_and_one(chat_data, tmp_path, {"zero": 3, "timeout_s": 20})
    for (loss, tokens), (one_loss, one_tokens) in zip(ranks, one, strict=True):
        assert tokens == one_tokens and loss == pytest.approx(one_loss, rel=1e-6)


@pytest.mark.slow
def test_context_parallel_validation_is_one_processs_loss(chat_data, tmp_path):
    """2 cp ranks, each scoring its half of every window's positions, on chat data. The 3rd window's trained
    targets all fall in rank 0's half and CASES' first scores it alone: a rank that averaged its own half would
    give 0/0 (NaN) there, and halves averaged as equals weigh targets unequally. Ring attention adds in another
    order than one process: fp32 rounding, 1e-5."""
    y = _targets(chat_data, 12)[2]
    half = SequenceShard(1, 2, zigzag=True).positions(len(y), torch.device("cpu"))
    assert (y != IGNORE).any() and (y[half] == IGNORE).all()
    ranks, one = _ranks_and_one(chat_data, tmp_path, {"cp": 2, "timeout_s": 20})
    for (loss, tokens), (one_loss, one_tokens) in zip(ranks, one, strict=True):
        assert tokens == one_tokens and loss == pytest.approx(one_loss, abs=1e-5)
