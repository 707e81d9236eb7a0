"""DeepSeek with multi-token prediction trains under data parallelism, ZeRO-3 and expert parallelism x ZeRO-3
exactly what one process trains: the losses, the prediction modules' loss (`mtp_loss`) and the final weights,
the modules' own (their block's experts split over the ep ranks) among them, agree within the
`test_expert_parallel` tolerance (fp32 rounding of other batch sizes and summation orders)."""

import pytest
import torch

from tests.helpers import read_metrics, tiny_config
from tests.models.test_deepseek import DEEPSEEK
from tests.multiprocess import run_ranks
from tests.parallel.test_expert_parallel import TOLERANCE, train_and_gather

MODEL = DEEPSEEK | {"mtp_depth": 1}


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{}, {"zero": 3}, {"ep": 2, "zero": 3}], ids=["ddp", "zero3", "ep2-zero3"])
def test_multi_token_prediction_on_two_ranks_matches_one_process(parallel, tmp_path):
    train = {"steps": 3, "optimizer": "sgd", "lr": 0.5, "mtp_weight": 0.5}
    reference = tiny_config(tmp_path / "one", model=MODEL, train=train | {"micro_batch_size": 4})
    expected, _ = train_and_gather(reference)
    run = tiny_config(tmp_path / "two", model=MODEL, parallel=parallel, train=train | {"micro_batch_size": 2})
    (weights, _), *_ = run_ranks(train_and_gather, 2, tmp_path, run)

    rows, reference_rows = read_metrics(run.run.dir), read_metrics(reference.run.dir)
    assert len(rows) == len(reference_rows) == 3
    for row, ref in zip(rows, reference_rows, strict=True):
        for key in ("loss", "mtp_loss"):
            assert abs(row[key] - ref[key]) < TOLERANCE, (key, row[key], ref[key])
    assert weights.keys() == expected.keys()
    assert any(key.startswith("mtp.depths.0.block.feed_forward.experts") for key in weights)
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=TOLERANCE, msg=key)
