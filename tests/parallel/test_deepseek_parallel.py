"""The DeepSeek family (MLA, a dense first block, shared and routed experts with group-limited sigmoid
routing and loss-free balancing) trains under ZeRO-3 and under expert parallelism exactly what one process
trains: the losses and the final weights, balancing bias included, agree. Tolerance as
`test_expert_parallel`: fp32 rounding of other batch sizes and summation orders, 1e-5 over 4 steps.
"""

import pytest
import torch

from tests.helpers import read_metrics, tiny_config
from tests.models.test_deepseek import DEEPSEEK
from tests.multiprocess import run_ranks
from tests.parallel.test_expert_parallel import TOLERANCE, train_and_gather

MODEL = DEEPSEEK | {"moe_bias_rate": 0.05}  # a fast bias: one that moved differently would change the routing


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"zero": 3}, {"ep": 2}], ids=["zero3", "ep2"])
def test_deepseek_on_two_ranks_matches_one_process(parallel, tmp_path):
    train = {"steps": 4, "optimizer": "sgd", "lr": 0.5}
    reference = tiny_config(tmp_path / "one", model=MODEL, train=train | {"micro_batch_size": 4})
    expected, _ = train_and_gather(reference)
    run = tiny_config(tmp_path / "two", model=MODEL, parallel=parallel, train=train | {"micro_batch_size": 2})
    (weights, _), *_ = run_ranks(train_and_gather, 2, tmp_path, run)

    rows, reference_rows = read_metrics(run.run.dir), read_metrics(reference.run.dir)
    assert len(rows) == len(reference_rows) == 4
    for row, ref in zip(rows, reference_rows, strict=True):
        assert abs(row["loss"] - ref["loss"]) < TOLERANCE, (row["loss"], ref["loss"])
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=TOLERANCE, msg=key)
    assert max(expected[f"layers.{i}.feed_forward.expert_bias"].abs().max() for i in (1, 2)) > 0
