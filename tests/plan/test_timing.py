import dataclasses

import pytest

from paralm.models.registry import model_config, model_shape
from paralm.plan import kernels
from paralm.plan.timing import step_time
from tests.plan.helpers import H100, NO_LATENCY, SHAPE, batched_layout, small_work

FREE_LINKS = dataclasses.replace(H100, intra_latency=0.0, inter_latency=0.0, intra_bandwidth=1e30, inter_bandwidth=1e30)


IDEAL = dataclasses.replace(NO_LATENCY, gemm_efficiency=((1.0, 1.0),), kernel_latency=0.0, memory_bandwidth=1e30)


def test_at_peak_compute_is_the_model_flops() -> None:
    """With matmuls at peak and free memory traffic, the roofline is the FLOP count: 6N + 12Lds per token."""
    time = step_time(batched_layout(), small_work(), IDEAL)
    flops = SHAPE.flops_per_token * 64 * SHAPE.block_size
    # 6N counts biases and norms as if they were matmul weights; they are elementwise work (free here).
    vectors = SHAPE.n_layer * (SHAPE.layer_params - SHAPE.layer_matrix_params) + SHAPE.final_norm_params
    assert time.compute_s == pytest.approx((flops - 6 * vectors * 64 * SHAPE.block_size) / IDEAL.peak("bf16"))
    assert time.recompute_s == time.bubble_s == time.tp_comm_s == time.dp_exposed_s == 0


def test_full_recompute_repeats_the_block_forwards() -> None:
    time = step_time(batched_layout(activation_checkpointing="full"), small_work(), IDEAL)
    linear, attention = SHAPE.layer_forward_flops(64 * SHAPE.block_size)
    assert time.recompute_s == pytest.approx(SHAPE.n_layer * (linear + attention) / IDEAL.peak("bf16"), rel=1e-3)


def test_small_matmuls_and_small_shards_run_further_from_peak() -> None:
    small, large, huge = (kernels.efficiency(H100, "bf16", size) for size in (64, 1024, 1e5))
    assert small < large < huge
    per_flop = [
        step_time(batched_layout(tp=t), small_work(), FREE_LINKS).compute_s * t for t in (1, 8)
    ]  # device-seconds of the same FLOPs
    assert per_flop[1] > per_flop[0]


def test_elementwise_work_is_memory_bound_and_kernels_have_a_floor() -> None:
    slow_memory = dataclasses.replace(IDEAL, memory_bandwidth=1e9)
    block = kernels.block_forward(slow_memory, "bf16", SHAPE, 1, 1, False, 2)
    tokens = SHAPE.block_size
    assert block.elementwise == pytest.approx(2 * tokens * SHAPE.d_model * 18 / 1e9)
    floor = dataclasses.replace(IDEAL, kernel_latency=1.0)
    block = kernels.block_forward(floor, "bf16", SHAPE, 1, 1, False, 2)
    assert (block.linear, block.attention) == pytest.approx((6.0, 2.0), rel=1e-3)
    assert block.elementwise == pytest.approx(SHAPE.elementwise_kernels)


def test_a_step_pays_one_latency_per_kernel_it_runs() -> None:
    """Each block's six weight matmuls run three times (forward, input and weight gradients), attention's
    two and the elementwise kernels three times (forward, twice in backward); the head's matmul and
    the loss's 3 kernels in forward, input and weight gradients."""
    floor = dataclasses.replace(IDEAL, kernel_latency=1.0)
    time = step_time(batched_layout(micro_batch_size=64), small_work(), floor)
    per_block = 3 * (6 + 2 + SHAPE.elementwise_kernels)
    assert time.compute_s == pytest.approx(SHAPE.n_layer * per_block + 3 * 4, rel=1e-3)


def test_a_thin_matmul_curve_prices_attention_at_the_head_dimension() -> None:
    """A curve measured on thin matrices is read at each matmul's smallest side, attention's tiles (s x hd
    by hd x s) too; a square-GEMM curve at the tiles' equivalent square."""
    square = dataclasses.replace(IDEAL, gemm_efficiency=((16.0, 0.1), (4096.0, 1.0)))
    thin = dataclasses.replace(square, gemm_shape="thin")
    hd, s = SHAPE.d_model // SHAPE.n_head, SHAPE.block_size
    times = [kernels.block_forward(c, "bf16", SHAPE, 1, 1, False, 2).attention for c in (square, thin)]
    assert times[1] / times[0] == pytest.approx(
        kernels.efficiency(square, "bf16", (s * s * hd) ** (1 / 3)) / kernels.efficiency(square, "bf16", hd)
    )
    assert times[1] > times[0]


def test_a_measured_attention_backward_is_priced_from_its_own_curve() -> None:
    """A listed kernel's forward runs at its curve's fraction; its backward, five matmuls to the forward's
    two, at `<kernel>_backward`'s; with no backward curve, twice the forward."""
    forward_only = dataclasses.replace(IDEAL, attention_efficiency={"flash2": ((1.0, 0.5),)})
    both = dataclasses.replace(IDEAL, attention_efficiency={"flash2": ((1.0, 0.5),), "flash2_backward": ((1.0, 0.25),)})
    hd, s = SHAPE.d_model // SHAPE.n_head, SHAPE.block_size
    causal_flops = 2 * 2 * s * s * hd * SHAPE.n_head / 2
    block = kernels.block_forward(forward_only, "bf16", SHAPE, 1, 1, False, 2)
    assert block.attention == pytest.approx(causal_flops / (0.5 * IDEAL.peak("bf16")))
    assert block.attention_backward == pytest.approx(2 * block.attention)
    measured = kernels.block_forward(both, "bf16", SHAPE, 1, 1, False, 2)
    assert measured.attention == pytest.approx(block.attention)
    assert measured.attention_backward == pytest.approx(2.5 * causal_flops / (0.25 * IDEAL.peak("bf16")))
    assert measured.input_gradients - block.input_gradients == pytest.approx(
        measured.attention_backward - 2 * block.attention
    )


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (8, 32)])
def test_1f1b_bubble_fraction(p: int, m: int) -> None:
    time = step_time(batched_layout(pp=p, pp_microbatches=m), small_work(), FREE_LINKS)
    assert time.bubble_s / time.compute_s == pytest.approx((p - 1) / m)


def test_tensor_parallel_all_reduces_per_block() -> None:
    """Megatron: 2 all-reduces forward and 2 backward per block, one each for embedding and head."""
    t, tokens = 8, 64 * SHAPE.block_size
    time = step_time(batched_layout(tp=t), small_work(), NO_LATENCY)
    one = 2 * (t - 1) / t * tokens * SHAPE.d_model * 2 / H100.intra_bandwidth
    assert time.tp_comm_s == pytest.approx((4 * SHAPE.n_layer + 2) * one)
    # SP: an all-gather and a reduce-scatter instead of each all-reduce, the same bytes; and one
    # all-reduce of the replicated parameters' gradients (their ranks saw parts of the sequence)
    sp = batched_layout(tp=t, sequence_parallel=True)
    replicated = SHAPE.n_layer * SHAPE.layer_replicated_params + SHAPE.final_norm_params + SHAPE.position_params
    norms = 2 * (t - 1) / t * replicated * 4 / H100.intra_bandwidth
    assert step_time(sp, small_work(), NO_LATENCY).tp_comm_s == pytest.approx(time.tp_comm_s + norms)
    # ... at the backend's speed for each half: a reduce-scatter 3x the ring model's time (gloo's kind)
    slow_scatter = dataclasses.replace(NO_LATENCY, reduce_scatter_factor=3.0)
    assert step_time(sp, small_work(), slow_scatter).tp_comm_s == pytest.approx(2 * time.tp_comm_s + norms)


def test_groups_that_span_nodes_use_the_network() -> None:
    """dp ranks 1 apart share a node (NVLink); with tp = 8 they are 8 apart, one per node (InfiniBand)."""
    intra = step_time(batched_layout(dp_shard=8, micro_batch_size=8), small_work(), NO_LATENCY, overlap=False)
    inter = step_time(batched_layout(dp_shard=8, tp=8, micro_batch_size=8), small_work(), NO_LATENCY, overlap=False)
    # A tp = 8 rank holds 1/8 of the split parameters and all the replicated ones (norms, positions).
    replicated = SHAPE.n_layer * SHAPE.layer_replicated_params + SHAPE.position_params + SHAPE.final_norm_params
    share = ((SHAPE.params - replicated) / 8 + replicated) / SHAPE.params
    expected = intra.dp_comm_s * share * H100.intra_bandwidth / H100.inter_bandwidth
    assert inter.dp_comm_s == pytest.approx(expected, rel=0.01)


def test_tensor_parallelism_leaves_the_whole_matrices_whole() -> None:
    """MLA's low-rank projections (`layer_whole_matrices`) run whole on every TP rank; the rest splits."""
    shape = model_shape(
        model_config(
            family="deepseek",
            n_layer=2,
            n_head=4,
            d_model=64,
            block_size=32,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
        )
    )
    assert shape.layer_whole_params == 24 * 64 + (32 + 8) * 64  # wq_a, and wkv_a with the shared RoPE key
    linear = [kernels.block_forward(IDEAL, "bf16", shape, 1, t, False, 2).linear for t in (1, 2)]
    whole = 2 * shape.block_size * shape.layer_whole_params / IDEAL.peak("bf16")
    assert linear[1] == pytest.approx(whole + (linear[0] - whole) / 2)


@pytest.mark.parametrize(
    ("recipe", "dp_shard", "zero", "casts"),
    [("fp32-master", 1, 0, True), ("fp32-master", 8, 1, True), ("fp32-master", 8, 3, False), ("paper", 1, 0, False)],
)
def test_autocast_casts_fp32_weights_in_every_forward_unless_fsdp_gathers_them_cast(recipe, dp_shard, zero, casts):
    """paralm's fp32 parameters under autocast: each forward reads every weight (the tied head's too) in fp32
    and writes its 16-bit copy, 6 bytes a parameter, and backward casts their gradients back as much. FSDP's
    gathers arrive cast; a recipe with 16-bit parameters has nothing to cast."""
    memory = dataclasses.replace(IDEAL, memory_bandwidth=1e12)
    work = dataclasses.replace(small_work(batch=dp_shard), recipe=recipe)
    base = dataclasses.replace(work, recipe="paper")
    layout = batched_layout(micro_batch_size=1, dp_shard=dp_shard, zero=zero)
    extra = step_time(layout, work, memory).compute_s - step_time(layout, base, memory).compute_s
    weights = SHAPE.n_layer * SHAPE.layer_params + SHAPE.embedding_params
    assert extra == pytest.approx(2 * weights * 6 / 1e12 if casts else 0.0, rel=1e-3)
