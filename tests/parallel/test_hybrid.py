"""Model parallelism composed with data parallelism on one device mesh equals one process.

2-D: FSDP (ZeRO-3) x TP, PP x DP (replicated) and PP x TP; 3-D: PP x DP x TP on 8 ranks. Each layout sees the
same global batch as the single process (data-parallel ranks split it). Tolerances as in
test_tensor_parallel: rounding only, 1e-6 on one step's loss and gradients, 1e-5 over the steps.
"""

import pytest

from paralm.job import train
from paralm.parallel.runtime import init_runtime
from tests.helpers import tiny_config
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import (
    assert_gradients_match,
    assert_runs_match,
    gradients_then_training,
    merged,
    one_step,
)


def _check(tmp_path, world, parallel, dp=2, steps=5):
    reference = tiny_config(tmp_path / "single", train={"micro_batch_size": 8, "steps": steps})
    loss, grads = one_step(reference, init_runtime(reference.parallel, reference.sync))
    train(reference)
    config = tiny_config(tmp_path / "hybrid", train={"micro_batch_size": 8 // dp, "steps": steps}, parallel=parallel)
    per_rank = run_ranks(gradients_then_training, world, tmp_path, [config])
    assert all(abs(results[0][0] - loss) < 1e-6 for results in per_rank)
    assert_gradients_match(grads, merged([results[0][1] for results in per_rank]), atol=1e-6)
    assert_runs_match(reference, config, atol=1e-5)


@pytest.mark.slow
def test_fsdp_by_tensor_parallel_matches_one_process(tmp_path):
    _check(tmp_path, 4, {"zero": 3, "tp": 2, "sequence_parallel": True})


@pytest.mark.slow
def test_pipeline_by_data_parallel_matches_one_process(tmp_path):
    _check(tmp_path, 4, {"pp": 2, "pp_microbatches": 2})


@pytest.mark.slow
def test_pipeline_by_sequence_parallel_matches_one_process(tmp_path):
    # the embedding's gradient comes back replicated over TP, the head copy's sharded: the tied sum must align them
    _check(tmp_path, 4, {"pp": 2, "tp": 2, "sequence_parallel": True, "pp_microbatches": 2}, dp=1)


@pytest.mark.slow
def test_pipeline_by_data_by_tensor_parallel_on_eight_ranks_matches_one_process(tmp_path):
    _check(tmp_path, 8, {"pp": 2, "tp": 2, "pp_schedule": "gpipe", "pp_microbatches": 2}, steps=2)
