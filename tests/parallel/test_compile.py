"""`train.compile` trains the model eager PyTorch trains: one process, DDP and ZeRO-3 with activation
checkpointing, an MoE model alone and under expert parallelism, each against one eager process on the
same global batch of 8 sequences.

SGD (no momentum) is used so weights can be compared: it passes rounding through linearly, where
AdamW's division by sqrt(v) can blow 1e-7 of noise on a near-zero gradient up to an lr-sized step.
Tolerance: inductor fuses and reorders fp32 arithmetic (and the data-parallel runs sum in another
order), so results differ by rounding, ~1e-6 relative; 1e-5 on losses and weights after 3 steps
bounds that, while a wrong gradient moves weights by ~1e-2 at lr 0.5.
"""

import pytest
import torch

from paralm.config.schema import Config
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks
from tests.parallel.test_zero import train_and_gather

TOLERANCE = 1e-5
SGD = {"optimizer": "sgd", "lr": 0.5, "steps": 3}


def _compiled_run(config: Config) -> tuple[dict[str, torch.Tensor], int]:
    """Final weights, and how many graphs dynamo compiled (0 would mean compile never ran)."""
    from torch._dynamo.utils import counters  # the only record of what dynamo compiled

    weights = train_and_gather([config])[0]
    return weights, counters["stats"]["unique_graphs"]


def _config(
    run_dir, ranks: int, compile: bool, parallel: dict | None = None, model: dict | None = None, **train
) -> Config:
    return tiny_config(
        run_dir,
        train={**SGD, "micro_batch_size": 8 // ranks, "compile": compile, **train},
        parallel=parallel or {},
        model=model or {},
    )


def _assert_same(reference_dir, reference, run_dir, weights) -> None:
    for a, b in zip(read_metrics(reference_dir), read_metrics(run_dir), strict=True):
        assert abs(a["loss"] - b["loss"]) < TOLERANCE
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=TOLERANCE, msg=name)


@pytest.mark.slow
def test_compiled_training_equals_eager_in_one_process_ddp_and_zero3(tmp_path):
    eager = _config(tmp_path / "eager", 1, compile=False)
    reference = train_and_gather([eager])[0]
    assert read_metrics(eager.run.dir)[-1]["loss"] < read_metrics(eager.run.dir)[0]["loss"]  # it trained

    layouts = {
        "single": (1, None, {}),
        "ddp": (2, None, {}),
        "zero3-ac": (2, {"zero": 3}, {"activation_checkpointing": "full"}),
    }
    for name, (ranks, parallel, train) in layouts.items():
        config = _config(tmp_path / name, ranks, compile=True, parallel=parallel, **train)
        # Every layout compiles in forked ranks, the single one too: a rank forked after inductor compiled in
        # this process inherits its compile pool without the pool's threads and waits on it forever.
        results = run_ranks(_compiled_run, ranks, tmp_path / name, config)
        for weights, graphs in results:
            assert graphs > 0, name
            _assert_same(eager.run.dir, reference, config.run.dir, weights)


@pytest.mark.slow
def test_a_compiled_llama_trains_as_the_eager_one_in_zero3_with_activation_checkpointing(tmp_path):
    llama = {"family": "llama", "n_head": 4, "n_kv_heads": 2, "ffn_hidden": 48}
    eager = _config(tmp_path / "eager", 1, compile=False, model=llama)
    reference = train_and_gather([eager])[0]
    config = _config(tmp_path / "zero3-ac", 2, True, {"zero": 3}, llama, activation_checkpointing="full")
    for weights, graphs in run_ranks(_compiled_run, 2, tmp_path / "zero3-ac", config):
        assert graphs > 0
        _assert_same(eager.run.dir, reference, config.run.dir, weights)


@pytest.mark.slow
def test_a_compiled_moe_model_trains_as_the_eager_one_alone_and_under_ep_2(tmp_path):
    """The tokens per expert, read as numbers (by the experts' loop where the grouped kernel does not take
    fp32, and by the all-to-all under ep), are traced as symbols: each block still compiles as one graph."""
    moe = {"moe_experts": 4, "moe_top_k": 2}
    eager = _config(tmp_path / "eager", 1, compile=False, model=moe)
    reference = train_and_gather([eager])[0]
    for name, ranks, parallel in (("one", 1, None), ("ep2", 2, {"ep": 2})):
        config = _config(tmp_path / name, ranks, True, parallel, moe)
        for weights, graphs in run_ranks(_compiled_run, ranks, tmp_path / name, config):
            assert graphs > 0, name
            _assert_same(eager.run.dir, reference, config.run.dir, weights)
