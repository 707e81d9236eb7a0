import pytest

from paralm.models.gpt2 import GPT
from paralm.models.registry import model_config, model_shape


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_layer,n_head,d_model", [(1, 1, 8), (3, 2, 16), (2, 4, 32)])
def test_parameter_count_matches_the_model(bias: bool, n_layer: int, n_head: int, d_model: int) -> None:
    config = model_config(n_layer=n_layer, n_head=n_head, d_model=d_model, block_size=24, vocab_size=40, bias=bias)
    model = GPT(config)
    shape = model_shape(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.flops_params == shape.params - model.wpe.weight.numel()
    matrices = [p for p in model.parameters() if p.dim() == 2]
    assert {tuple(p.shape) for p in matrices} == {(rows, cols) for rows, cols, _ in shape.matrices}
    assert sum(p.numel() for p in matrices) == sum(rows * cols * n for rows, cols, n in shape.matrices)


def test_gpt3_175b_has_175b_parameters() -> None:
    """Brown et al. 2020, table 2.1: 96 layers, d_model 12288, 96 heads, context 2048."""
    shape = model_shape(model_config(n_layer=96, n_head=96, d_model=12288, block_size=2048, vocab_size=50257))
    assert shape.params == pytest.approx(175e9, rel=0.01)


def test_per_layer_flops_add_up_to_the_convention() -> None:
    """Forward FLOPs of the blocks and the head, times 3 (forward + backward), are 6N + 12 L d s."""
    shape = model_shape(model_config(n_layer=5, n_head=4, d_model=64, block_size=32, vocab_size=100))
    linear, attention = shape.layer_forward_flops(tokens=1)
    assert 3 * (shape.n_layer * (linear + attention) + shape.head_forward_flops(1)) == shape.flops_per_token
