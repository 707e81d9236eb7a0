"""The masked loss (chat data): the sum over trained targets divided by their count in the whole global
batch, so accumulation, data parallelism and ZeRO-3 give one process's loss; document masks compose.

Tolerances: the layouts add the same per-token losses and gradients in another order, fp32 rounding
only (about 5e-7 seen on losses near 5.7): within 1e-5 over 3 AdamW steps, 1e-6 on one step's loss.
"""

import pytest
import torch
import torch.nn.functional as F

from paralm.data.shards import IGNORE
from paralm.job import train
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer
from tests.chat_helpers import chat_dataset
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return chat_dataset(tmp_path_factory.mktemp("sft"))


def _config(run_dir, data, parallel=None, document_mask=False, model=None, **train_fields):
    return tiny_config(
        run_dir,
        model={"vocab_size": 300, **(model or {})},
        data={"path": str(data), "document_mask": document_mask},
        train={"steps": 3, "eval_samples": 8, **train_fields},
        parallel=parallel or {},
    )


def _losses(config):
    return [row["loss"] for row in read_metrics(config.run.dir)]


def test_the_loss_is_the_mean_over_the_global_batchs_trained_targets(chat_data, tmp_path):
    config = _config(tmp_path / "a", chat_data, micro_batch_size=2, grad_accum=2)
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime)
    batch = trainer.engine.step_batch()
    loss = trainer.engine.forward_backward(batch).item()
    with torch.no_grad():
        summed = sum(
            F.cross_entropy(trainer.engine.model(x).flatten(0, 1), y.flatten(), reduction="sum")
            for x, y in batch.micro_batches
        )
    trained = sum(int((y != IGNORE).sum()) for _, y in batch.micro_batches)
    shutdown(runtime)
    assert batch.trained == trained and 0 < trained < 4 * 32
    assert loss == pytest.approx(summed.item() / trained, rel=1e-6)


def test_accumulation_weighs_every_trained_token_alike(chat_data, tmp_path):
    one = _config(tmp_path / "one", chat_data, micro_batch_size=4)
    four = _config(tmp_path / "four", chat_data, micro_batch_size=1, grad_accum=4)
    train(one)
    train(four)
    assert max(abs(a - b) for a, b in zip(_losses(one), _losses(four), strict=True)) < 1e-5
    rows = read_metrics(one.run.dir)
    assert 0 < rows[-1]["trained_tokens_per_s"] < rows[-1]["tokens_per_s"] and "val_loss" in rows[-1]


def _train(config):
    train(config)


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel, document_mask",
    [
        ({"zero": 0}, False),
        ({"zero": 3}, True),
        ({"tp": 2}, True),
        ({"pp": 2, "pp_microbatches": 2}, True),
        ({"cp": 2}, False),
        ({"ep": 2}, True),
    ],
    ids=["ddp", "zero3-documents", "tp2-documents", "pp2-documents", "cp2", "ep2-moe-documents"],
)
def test_two_ranks_match_one_process(chat_data, tmp_path, parallel, document_mask):
    """DDP, ZeRO-3, TP, 2 pipeline stages and ep 2 (an MoE model) with document masks, and context parallelism
    (which refuses document masks): 2 ranks give 1 process's loss (data and expert parallelism: 2 sequences each
    of 1 process's 4; TP, PP and CP: the same 4, split by heads, stages or positions)."""
    moe = {"moe_experts": 4, "moe_top_k": 2} if "ep" in parallel else None  # ep splits an MoE model's experts
    single = _config(tmp_path / "single", chat_data, None, document_mask, moe, micro_batch_size=4)
    per_rank = 2 if "zero" in parallel or "ep" in parallel else 4
    ranks = _config(tmp_path / "ranks", chat_data, parallel, document_mask, moe, micro_batch_size=per_rank)
    train(single)
    run_ranks(_train, 2, tmp_path, ranks)
    assert max(abs(a - b) for a, b in zip(_losses(single), _losses(ranks), strict=True)) < 1e-5
