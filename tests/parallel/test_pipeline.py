"""Pipeline parallelism equals one process, for every schedule of `torch.distributed.pipelining`.

Each schedule runs the same micro-batches through the same layers; what differs is the order of
forwards and backwards over ranks, so the gradients are the same sums in another order (and the tied
embedding's gradient is the sum of the first and last stage's parts, added across ranks). Rounding
only: we allow 1e-6 absolute on every gradient entry and the first loss, 1e-5 on 5 steps' losses
and gradient norms (as for tensor parallelism, see test_tensor_parallel).
"""

from unittest import mock

import pytest
import torch

from paralm.config.schedules import fewest_stages_per_rank
from paralm.config.schema import PIPELINE_SCHEDULES
from paralm.job import train
from paralm.models.gpt2 import GPT
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer
from tests.helpers import tiny_config
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import (
    assert_gradients_match,
    assert_runs_match,
    gradients_then_training,
    merged,
    one_step,
)

# (schedule, model chunks per rank): every schedule paralm offers, with the fewest chunks it takes
PP2_SCHEDULES = [(name, fewest_stages_per_rank(name)) for name in PIPELINE_SCHEDULES]


def _reference(tmp_path, n_layer):
    config = tiny_config(tmp_path / f"single{n_layer}", model={"n_layer": n_layer})
    loss, grads = one_step(config, init_runtime(config.parallel, config.sync))
    train(config)
    return config, loss, grads


def _check(tmp_path, pp, schedules, n_layer):
    reference, loss, grads = _reference(tmp_path, n_layer)
    configs = [
        tiny_config(
            tmp_path / f"{schedule}_v{virtual}",
            model={"n_layer": n_layer},
            parallel={"pp": pp, "pp_schedule": schedule, "pp_virtual_stages": virtual, "pp_microbatches": 4},
        )
        for schedule, virtual in schedules
    ]
    per_rank = run_ranks(gradients_then_training, pp, tmp_path, configs)
    for i, config in enumerate(configs):
        last_stage_losses = [results[i][0] for results in per_rank]
        assert all(abs(x - loss) < 1e-6 for x in last_stage_losses), (config.parallel.pp_schedule, last_stage_losses)
        assert_gradients_match(grads, merged([results[i][1] for results in per_rank]), atol=1e-6)
        assert_runs_match(reference, config, atol=1e-5)


@pytest.mark.slow
def test_every_schedule_on_two_stages_matches_one_process(tmp_path):
    _check(tmp_path, 2, PP2_SCHEDULES, n_layer=4)


@pytest.mark.slow
def test_four_stages_with_1f1b_and_interleaved_1f1b_match_one_process(tmp_path):
    _check(tmp_path, 4, [("1f1b", 1), ("interleaved_1f1b", 2)], n_layer=8)


def _held_parameters(config):
    """The rank's parameters by name, and how many elements it allocated for meta tensors on the way."""
    allocated = []
    to_empty = torch.nn.Module.to_empty

    def counting_to_empty(module, *args, **kwargs):
        allocated.append(sum(p.numel() for p in module.parameters() if p.is_meta))
        return to_empty(module, *args, **kwargs)

    runtime = init_runtime(config.parallel, config.sync)
    with mock.patch.object(torch.nn.Module, "to_empty", counting_to_empty):
        trainer = Trainer(config, runtime)
    held = {name: p.numel() for name, p in trainer.engine.model.named_parameters()}
    shutdown(runtime)
    return held, sum(allocated)


@pytest.mark.slow
def test_each_pipeline_rank_holds_and_allocates_only_its_stages(tmp_path):
    """Two stages of a 2-layer model: the first holds the embeddings and block 0, the last block 1, the final
    norm and its copy of the tied embedding; together they hold the whole model once (plus that copy)."""
    config = tiny_config(tmp_path / "pp", parallel={"pp": 2})
    (first, first_allocated), (last, last_allocated) = run_ranks(_held_parameters, 2, tmp_path, config)
    whole = {name: p.numel() for name, p in GPT(config.model).named_parameters()}
    assert {name.split(".")[0] for name in first} == {"wte", "wpe", "blocks"}
    assert {name.split(".")[1] for name in first if name.startswith("blocks.")} == {"0"}
    assert {name.split(".")[0] for name in last} == {"blocks", "ln_f", "lm_head"}
    assert {name.split(".")[1] for name in last if name.startswith("blocks.")} == {"1"}
    assert first.keys().isdisjoint(last.keys())
    assert {**first, **last} == {**whole, "lm_head.weight": whole["wte.weight"]}
    assert sum(first.values()) + sum(last.values()) == sum(whole.values()) + whole["wte.weight"]
    # stages are cut on the meta device: a rank allocates its own stages' weights, never the whole model's
    assert first_allocated == sum(first.values()) and last_allocated == sum(last.values())
