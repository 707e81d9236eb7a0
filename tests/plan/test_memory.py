import dataclasses

import pytest

from paralm.models.registry import model_config, model_shape
from paralm.models.shape import ModelShape
from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Workload
from paralm.plan.memory import backward_working_set, device_memory, layer_activation_bytes, model_states, rank_params
from tests.plan.helpers import layout as _layout


@pytest.mark.parametrize("zero,gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_worked_example(zero: int, gigabytes: float) -> None:
    """Rajbhandari et al. 2020, figure 1: Psi = 7.5B, N_d = 64, mixed-precision Adam (K = 12)."""
    states = model_states(7.5e9, "bf16", "paper", optimizer_slots=2, zero=zero, shards=64)
    total = states.param_bytes + states.grad_bytes + states.optim_bytes
    assert round(total / 1e9, 1) == gigabytes


def test_state_recipes_differ_where_real_systems_do() -> None:
    fp32_grads = model_states(1.0, "bf16", "fp32-grads", 2, zero=0, shards=1)
    autocast = model_states(1.0, "bf16", "fp32-master", 2, zero=1, shards=4)
    assert (fp32_grads.param_bytes, fp32_grads.grad_bytes, fp32_grads.optim_bytes) == (2, 4, 12)
    assert (autocast.param_bytes, autocast.grad_bytes, autocast.optim_bytes) == (4, 4, 2)
    fp32 = model_states(1.0, "fp32", "paper", 2, zero=0, shards=1)  # no master copy when computing in fp32
    assert (fp32.param_bytes, fp32.grad_bytes, fp32.optim_bytes) == (4, 4, 8)


S, B, H, A = 2048, 4, 12288, 96  # Korthikanti et al.'s GPT-3 175B shapes


@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_per_layer_activations(t: int) -> None:
    """Korthikanti et al. 2022, sec. 4 (table 2): bytes per layer, 16-bit activations with dropout."""
    sbh, ash = S * B * H, 5 * A * S / H
    assert layer_activation_bytes(S, B, H, A, t=t) == pytest.approx(sbh * (10 + 24 / t + ash / t))
    assert layer_activation_bytes(S, B, H, A, t=t, sp=True) == pytest.approx(sbh / t * (34 + ash))
    assert layer_activation_bytes(S, B, H, A, t=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activation_bytes(S, B, H, A, t=t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert layer_activation_bytes(S, B, H, A, t=t, recompute="full") == pytest.approx(2 * sbh)
    assert layer_activation_bytes(S, B, H, A, t=t, sp=True, recompute="full") == pytest.approx(2 * sbh / t)


def test_no_parallelism_is_the_papers_first_form() -> None:
    assert layer_activation_bytes(S, B, H, A) == pytest.approx(S * B * H * (34 + 5 * A * S / H))


def test_fused_attention_keeps_no_score_matrix() -> None:
    """FlashAttention: the s x s terms go, its output (one sbh) and the fp32 log-sum-exp stay."""
    flash = layer_activation_bytes(S, B, H, A, dropout=False, flash=True)
    assert flash == pytest.approx(S * B * H * 34 + 4 * A * S * B)


def _work(shape: ModelShape, batch: int = 8, dtype: str = "bf16") -> Workload:
    return Workload(shape, batch, dtype, "fp32", 2, False, "paper", 25 * 2**20)


SHAPE = model_shape(model_config(n_layer=8, n_head=8, d_model=512, block_size=256, vocab_size=1024))


def test_tensor_parallel_shards_add_up_to_the_model() -> None:
    """Split parameters summed over t ranks plus one copy of the replicated ones is the whole model."""
    whole = rank_params(SHAPE, _layout(), _layout().ranks(SHAPE)[0])
    t = 4
    layout = _layout(tp=t)
    shard = rank_params(SHAPE, layout, layout.ranks(SHAPE)[0])
    replicated = SHAPE.n_layer * SHAPE.layer_replicated_params + SHAPE.position_params + SHAPE.final_norm_params
    assert whole == SHAPE.params
    assert t * (shard - replicated) + replicated == pytest.approx(whole)


def test_1f1b_first_stage_holds_a_whole_model_of_activations() -> None:
    """Korthikanti et al. sec. 4.2.3: with 1F1B the first stage keeps p micro-batches of L/p layers."""
    per_layer = layer_activation_bytes(256, 2, 512, 8, element_bytes=2, dropout=False, flash=True)
    for p in (2, 4, 8):
        layout = _layout(pp=p, pp_microbatches=4 * p, micro_batch_size=8 * p)  # pipeline micro-batch of 2
        memory = device_memory(layout, _work(SHAPE), PRESETS["h100"])
        working_set = backward_working_set(256 * 2, 512, 1, False, 2)
        assert memory.activation_bytes - working_set == pytest.approx(SHAPE.n_layer * per_layer)


def test_checkpointing_trades_memory_in_order() -> None:
    used = [
        device_memory(_layout(micro_batch_size=8, activation_checkpointing=ac), _work(SHAPE), PRESETS["h100"])
        for ac in ("none", "selective", "full")
    ]
    assert used[0].activation_bytes > used[1].activation_bytes > used[2].activation_bytes
    assert used[0].param_bytes == used[2].param_bytes


def test_zero3_gathers_are_buffers_and_shrink_states() -> None:
    dense = device_memory(_layout(dp_shard=8), _work(SHAPE), PRESETS["h100"])
    sharded = device_memory(_layout(dp_shard=8, zero=3), _work(SHAPE), PRESETS["h100"])
    assert sharded.param_bytes == pytest.approx(dense.param_bytes / 8)
    assert sharded.buffer_bytes > dense.buffer_bytes


def test_fsdp_keeps_what_paralm_measures() -> None:
    """ZeRO-2 on FSDP2 (reshard_after_forward=False) keeps the gathered compute-dtype parameters beside
    the sharded fp32 master; accumulating with sync off keeps whole gradients (paralm.train.memory)."""
    work = dataclasses.replace(_work(SHAPE), recipe="fp32-master")
    params = SHAPE.params
    zero2 = device_memory(_layout(dp_shard=8, zero=2), work, PRESETS["h100"])
    assert zero2.param_bytes == pytest.approx(params * 2 + params * 4 / 8)
    assert zero2.grad_bytes == pytest.approx(params * 4 / 8)
    once = device_memory(_layout(dp_shard=8, zero=3), work, PRESETS["h100"])
    accumulating = device_memory(_layout(dp_shard=8, zero=3, grad_accum=4), work, PRESETS["h100"])
    # the states at the end of the last backward are the shard either way; the unsharded gradients
    # accumulated between micro-steps are a buffer, unless they are reduce-scattered every micro-step
    assert accumulating.grad_bytes == once.grad_bytes == pytest.approx(params * 4 / 8)
    assert accumulating.buffer_bytes - once.buffer_bytes == pytest.approx(params * 4)
    sharded = dataclasses.replace(work, sharded_accumulation=True)
    every = device_memory(_layout(dp_shard=8, zero=3, grad_accum=4), sharded, PRESETS["h100"])
    assert every.buffer_bytes == pytest.approx(once.buffer_bytes)


def test_zero1_holds_whole_gradients_until_after_backward() -> None:
    """paralm's ZeRO-1 reduce-scatters after backward: its states keep the shard (the paper's form), and
    the rest of the whole gradients it holds until then is a buffer, so the peak counts them all."""
    work = dataclasses.replace(_work(SHAPE), recipe="fp32-master")
    dense = device_memory(_layout(dp_shard=8), work, PRESETS["h100"])
    zero1 = device_memory(_layout(dp_shard=8, zero=1), work, PRESETS["h100"])
    assert zero1.grad_bytes == pytest.approx(dense.grad_bytes / 8) == pytest.approx(SHAPE.params * 4 / 8)
    assert zero1.grad_bytes + zero1.buffer_bytes - dense.buffer_bytes == pytest.approx(dense.grad_bytes)
    assert zero1.optim_bytes == pytest.approx(dense.optim_bytes / 8)
