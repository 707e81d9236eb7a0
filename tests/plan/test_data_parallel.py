"""Data parallelism's share of a step (`paralm.plan.data_parallel`): the bytes DDP, ZeRO-1/2/3 and the
compression hooks move, what of them hides behind compute, and FSDP's buffer copies."""

import dataclasses

import pytest

from paralm.models.registry import model_config, model_shape
from paralm.plan.data_parallel import powersgd_elements
from paralm.plan.timing import step_time
from tests.plan.helpers import H100, NO_LATENCY, SHAPE, batched_layout, small_work


def test_zero1_moves_what_ddp_moves_after_backward() -> None:
    """paralm's ZeRO-1 reduce-scatters fp32 gradients and all-gathers fp32 parameters after backward:
    DDP's ring all-reduce bytes, none of it hidden behind backward, plus its copies into and out of
    its buckets (gradients and parameters, each copy read and written, the shards twice)."""
    lay, work = (
        batched_layout(dp_shard=64, micro_batch_size=1, zero=1),
        dataclasses.replace(small_work(), recipe="fp32-master"),
    )
    ddp = step_time(batched_layout(dp_shard=64, micro_batch_size=1), work, NO_LATENCY, overlap=False).dp_comm_s
    zero1 = step_time(lay, work, NO_LATENCY, overlap=False)
    assert zero1.dp_comm_s == pytest.approx(ddp)
    copies = 2 * (1 + 1 / 64) * 2 * SHAPE.params * 4 / NO_LATENCY.memory_bandwidth
    assert step_time(lay, work, NO_LATENCY, overlap=True).dp_exposed_s == pytest.approx(ddp + copies)


@pytest.mark.parametrize("zero", [2, 3])
def test_accumulation_reduces_once_unless_sharded(zero: int) -> None:
    """FSDP2 with sync off until the last micro-step reduces once per step; DeepSpeed-style sharded
    accumulation reduce-scatters after every micro-step."""
    work = small_work(reduce_dtype="bf16")
    one, four = (batched_layout(dp_shard=64, micro_batch_size=16, grad_accum=a, zero=zero) for a in (1, 4))
    base = step_time(one, work, NO_LATENCY, overlap=False).dp_comm_s
    once = step_time(four, work, NO_LATENCY, overlap=False).dp_comm_s
    every = step_time(four, dataclasses.replace(work, sharded_accumulation=True), NO_LATENCY, overlap=False).dp_comm_s
    reduce = base / 3 if zero == 3 else base / 2  # ZeRO-3: 2 gathers + 1 reduce-scatter; ZeRO-2: 1 + 1
    gathers = base - reduce
    assert once == pytest.approx((4 if zero == 3 else 1) * gathers + reduce)
    assert every == pytest.approx(once + 3 * reduce)


def test_zero3_moves_one_and_a_half_times_ddp() -> None:
    """Rajbhandari et al. sec. 7: ZeRO-3 all-gathers twice and reduce-scatters once, 3 Psi against 2 Psi."""
    work = small_work(reduce_dtype="bf16")
    ddp = step_time(batched_layout(dp_shard=64, micro_batch_size=1), work, NO_LATENCY, overlap=False)
    zero3 = step_time(batched_layout(dp_shard=64, micro_batch_size=1, zero=3), work, NO_LATENCY, overlap=False)
    zero2 = step_time(batched_layout(dp_shard=64, micro_batch_size=1, zero=2), work, NO_LATENCY, overlap=False)
    assert zero3.dp_comm_s == pytest.approx(1.5 * ddp.dp_comm_s)
    assert zero2.dp_comm_s == pytest.approx(ddp.dp_comm_s)


def test_overlap_hides_only_what_compute_covers() -> None:
    layout = batched_layout(dp_shard=64, micro_batch_size=1)
    hidden, shown = step_time(layout, small_work(), H100), step_time(layout, small_work(), H100, overlap=False)
    assert hidden.dp_exposed_s < shown.dp_exposed_s == shown.dp_comm_s == hidden.dp_comm_s
    assert hidden.dp_exposed_s >= shown.dp_comm_s - hidden.compute_s


def test_devices_that_do_not_overlap_hide_nothing() -> None:
    """`comm_overlap` is the fraction of the overlappable time compute hides (calibrate measures it)."""
    layout = batched_layout(dp_shard=64, micro_batch_size=1)
    full, shown = step_time(layout, small_work(), H100), step_time(layout, small_work(), H100, overlap=False)
    none = step_time(layout, small_work(), dataclasses.replace(H100, comm_overlap=0.0))
    half = step_time(layout, small_work(), dataclasses.replace(H100, comm_overlap=0.5))
    assert none.dp_exposed_s == pytest.approx(shown.dp_exposed_s)
    hidden = shown.dp_exposed_s - full.dp_exposed_s
    assert hidden > 0 and half.dp_exposed_s == pytest.approx(shown.dp_exposed_s - hidden / 2)


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_pays_its_buffer_copies(zero: int) -> None:
    """FSDP2 copies parameters and gradients in and out of its flat buffers: memory-bound, not hidden."""
    layout = batched_layout(dp_shard=64, micro_batch_size=1, zero=zero)
    fast = step_time(layout, small_work(), NO_LATENCY, overlap=False)
    slow = step_time(
        layout,
        small_work(),
        dataclasses.replace(NO_LATENCY, memory_bandwidth=NO_LATENCY.memory_bandwidth / 2),
        overlap=False,
    )
    copies = fast.dp_exposed_s - fast.dp_comm_s
    assert copies > 0 and slow.dp_exposed_s - slow.dp_comm_s == pytest.approx(2 * copies)


def test_compression_shrinks_the_gradient_exchange() -> None:
    layout = batched_layout(dp_shard=64, micro_batch_size=1)
    plain = step_time(layout, small_work(), NO_LATENCY).dp_comm_s
    half = step_time(layout, dataclasses.replace(small_work(), compression="bf16"), NO_LATENCY).dp_comm_s
    low_rank = step_time(layout, dataclasses.replace(small_work(), compression="powersgd"), NO_LATENCY).dp_comm_s
    sparse = step_time(layout, dataclasses.replace(small_work(), compression="topk"), NO_LATENCY).dp_comm_s
    assert half == pytest.approx(plain / 2)
    assert low_rank < plain / 50  # rank 4 of 1024-wide matrices
    # 1% of the entries at 8 bytes, gathered from 63 peers, against 2 x 63/64 x 4 bytes per entry
    assert sparse == pytest.approx(plain * 0.01 * 8 * 63 / (2 * 63 / 64 * 4), rel=0.01)


def test_powersgd_counts_only_the_matrices_it_shrinks() -> None:
    tiny = model_shape(model_config(n_layer=1, n_head=1, d_model=8, block_size=8, vocab_size=16))
    assert powersgd_elements(tiny, rank=4) == tiny.params  # 8 x 8 at rank 4 would not halve
    assert powersgd_elements(SHAPE, rank=1) < SHAPE.params / 100
