"""An MoE block under FP8: its experts' matmuls at the FP8 peak with their casts, as the dense blocks'."""

from paralm.models.registry import model_config, model_shape
from paralm.plan import kernels
from tests.plan.helpers import H100

SMALL = dict(n_layer=2, d_model=256, n_head=4, ffn_hidden=512, block_size=128, vocab_size=512)


def _block(float8: bool, **moe: int) -> kernels.BlockTimes:
    shape = model_shape(model_config("llama", **SMALL, **moe))
    return kernels.block_forward(H100, "bf16", shape, 4, 1, False, 2, float8=float8, compiled=True)


def test_one_expert_as_wide_as_the_dense_feed_forward_prices_as_it_under_fp8() -> None:
    """Every token routed to one expert the dense feed-forward's shape: the same FP8 matmuls and casts, plus only
    the passes that move the routed rows (`kernels.PERMUTATION_PASSES`)."""
    dense, moe = _block(True), _block(True, moe_experts=1, moe_top_k=1, moe_hidden=512)
    assert abs(moe.linear - dense.linear) < 1e-12
    tokens = 4 * SMALL["block_size"]
    permutation = kernels.PERMUTATION_PASSES * tokens * SMALL["d_model"] * 2 / H100.memory_bandwidth
    assert abs(moe.elementwise - permutation - dense.elementwise) < 1e-12


def test_fp8_casts_every_routed_copy() -> None:
    """A token routed to 4 experts is cast 4 times: FP8's casts (its elementwise work over bf16's) grow with top-k,
    by at least the 3 more copies of every token read (2 bytes) and written (1) into an expert's first matmul."""

    def casts(top_k: int) -> float:
        moe = dict(moe_experts=4, moe_top_k=top_k, moe_hidden=128)
        return _block(True, **moe).elementwise - _block(False, **moe).elementwise

    tokens = 4 * SMALL["block_size"]
    assert casts(4) - casts(1) >= 3 * tokens * SMALL["d_model"] * 3 / H100.memory_bandwidth
