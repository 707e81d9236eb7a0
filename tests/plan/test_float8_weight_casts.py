"""FP8 weight casts once per step (Transformer Engine's weight caching) against every forward (torchao)."""

import dataclasses

from paralm.plan import kernels
from paralm.plan.timing import step_time
from paralm.plan.validate import RUNS, bases, predict
from tests.plan.helpers import H100, SHAPE, batched_layout, small_work


def _elementwise(share: float) -> float:
    return kernels.block_forward(
        H100, "bf16", SHAPE, 4, 1, False, 2, float8=True, compiled=True, float8_weight_share=share
    ).elementwise


def test_weights_cast_once_per_step_save_their_bytes_on_the_later_micro_batches() -> None:
    """A block's weight casts read 2 bytes and write 1 per weight (compiled: the amax fused); kept over 8
    micro-batches, 7/8 of those bytes go."""
    weights = sum(rows * cols * count for rows, cols, count in SHAPE.layer_matrices)
    saved = _elementwise(1.0) - _elementwise(1 / 8)
    assert abs(saved - 3 * weights * (1 - 1 / 8) / H100.memory_bandwidth) < 1e-12


def test_a_step_casts_its_weights_once_however_many_micro_batches() -> None:
    """With casts per step, more micro-batches of the same step spread one cast thinner; per forward
    every micro-batch pays it."""
    work = dataclasses.replace(small_work(), float8=True, compiled=True)
    cached = dataclasses.replace(work, float8_weight_casts="step")
    for accum in (1, 4):
        layout = batched_layout(micro_batch_size=64 // accum, grad_accum=accum)
        each, once = step_time(layout, work, H100).compute_s, step_time(layout, cached, H100).compute_s
        assert (once < each) == (accum > 1)


def test_megatron_bridge_rows_price_transformer_engines_caching() -> None:
    """The published Megatron-Bridge rows run Transformer Engine: priced with casts per step, each is faster
    than with torchao's casts per forward."""
    rows = [run for run in RUNS if run.float8_weight_casts == "step"]
    assert {run.origin for run in rows} == {"Megatron-Bridge"}
    base = bases("h100")["h100"]
    for run in rows:
        assert predict(run, base) > predict(dataclasses.replace(run, float8_weight_casts="forward"), base)
