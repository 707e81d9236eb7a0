"""The DeepSeek family (MLA, a dense first block, shared and routed experts with group-limited sigmoid
routing and loss-free balancing) trains under ZeRO-3, under expert parallelism and under tensor + sequence
parallelism exactly what one process trains: the losses and the final weights, balancing bias included,
agree. Tolerance as `test_expert_parallel`: fp32 rounding of other batch sizes and summation orders, 1e-5
over 4 steps. Under TP each rank holds half of MLA's heads (`wq`, `wkv_b` rows; `wo` columns); a shared
RoPE key whose gradient were not summed over the group would move `wkv_a` by far more than that.
"""

import pytest
import torch

from paralm.parallel.tensor import local_value
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, tiny_config
from tests.models.test_deepseek import DEEPSEEK
from tests.multiprocess import run_ranks
from tests.parallel.test_expert_parallel import TOLERANCE, train_and_gather

MODEL = DEEPSEEK | {"moe_bias_rate": 0.05}  # a fast bias: one that moved differently would change the routing


def train_gather_and_look(config, look=lambda model: None) -> tuple[dict[str, torch.Tensor], object]:
    """`train_and_gather`'s weights, and what `look` reads off the trained model on this rank."""
    seen: list[object] = []
    original = Trainer.fit

    def fit(self):
        original(self)
        seen.append(look(self.engine.model))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "fit", fit)
        weights, _ = train_and_gather(config)
    return weights, seen[0]


def attention_rows(model) -> tuple[int, ...]:
    """The rows of the first block's `wq` and `wkv_b` this rank holds."""
    attention = model.get_submodule("layers.0.attention")
    return tuple(local_value(getattr(attention, name).weight).shape[0] for name in ("wq", "wkv_b"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel", [{"zero": 3}, {"ep": 2}, {"tp": 2, "sequence_parallel": True}], ids=["zero3", "ep2", "tp2-sp"]
)
def test_deepseek_on_two_ranks_matches_one_process(parallel, tmp_path):
    train = {"steps": 4, "optimizer": "sgd", "lr": 0.5}
    reference = tiny_config(tmp_path / "one", model=MODEL, train=train | {"micro_batch_size": 4})
    expected, _ = train_and_gather(reference)
    dp = 2 // parallel.get("tp", 1)
    run = tiny_config(tmp_path / "two", model=MODEL, parallel=parallel, train=train | {"micro_batch_size": 4 // dp})
    (weights, held), *_ = run_ranks(train_gather_and_look, 2, tmp_path, run, attention_rows)

    if parallel.get("tp"):  # half the heads' rows on this rank (zero3 shards rows too, so only tp is checked)
        assert held == tuple(expected[f"layers.0.attention.{name}.weight"].shape[0] // 2 for name in ("wq", "wkv_b"))

    rows, reference_rows = read_metrics(run.run.dir), read_metrics(reference.run.dir)
    assert len(rows) == len(reference_rows) == 4
    for row, ref in zip(rows, reference_rows, strict=True):
        assert abs(row["loss"] - ref["loss"]) < TOLERANCE, (row["loss"], ref["loss"])
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=TOLERANCE, msg=key)
    assert max(expected[f"layers.{i}.feed_forward.expert_bias"].abs().max() for i in (1, 2)) > 0


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_recomputed_deepseek_blocks_train_as_stored_ones(checkpointing, tmp_path):
    """Activation checkpointing replays MLA and the group-limited routing identically: losses and weights
    (balancing bias included) equal the run that stores its activations."""
    train = {"steps": 3, "optimizer": "sgd", "lr": 0.5, "micro_batch_size": 4}
    expected, _ = train_and_gather(tiny_config(tmp_path / "stored", model=MODEL, train=train))
    run = tiny_config(tmp_path / checkpointing, model=MODEL, train=train | {"activation_checkpointing": checkpointing})
    weights, wrapped = train_gather_and_look(run, lambda model: [type(b).__name__ for b in model.layers.values()])
    assert wrapped.count("CheckpointWrapper") == (3 if checkpointing == "full" else 1), wrapped  # every 2nd of 3
    rows, reference_rows = read_metrics(run.run.dir), read_metrics(tmp_path / "stored")
    assert [row["loss"] for row in rows] == pytest.approx([row["loss"] for row in reference_rows], abs=TOLERANCE)
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=TOLERANCE, msg=key)
