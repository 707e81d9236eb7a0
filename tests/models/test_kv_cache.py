"""The KV cache, for every family: a sequence fed in pieces through a `KVCache` gives the logits of one
full forward, and greedy generation with the cache gives the tokens it gives without, also once the
sequence is longer than the context and the window slides.

Tolerance 1e-5: with a cache the same products are computed over the same keys and values, but as other
matrix shapes (a piece's rows instead of the whole sequence's, an explicit mask instead of `is_causal`),
so fp32 sums may round in another order: measured at most 1.2e-6 on logits of up to about 2, so 1e-5 leaves a
factor 8 for other seeds and CPUs while any real error (a wrong position, a missing key) is orders larger.
"""

import pytest
import torch

from paralm.models.kv_cache import KVCache
from paralm.models.registry import model_config, model_spec
from paralm.models.sampling import generate
from tests.helpers import widened

CACHE_TOLERANCE = 1e-5  # see the module docstring

FAMILIES = {
    "gpt2": model_config(n_layer=2, n_head=4, d_model=32, block_size=24, vocab_size=64),
    "llama-gqa": model_config(
        family="llama", n_layer=2, n_head=4, n_kv_heads=2, d_model=32, ffn_hidden=64, block_size=24, vocab_size=64
    ),
}


@pytest.fixture(params=FAMILIES.values(), ids=FAMILIES.keys())
def model(request) -> torch.nn.Module:
    """The family's model with sharp attention (`widened`): a freshly initialised model's greedy text is
    one token repeated, which a wrong cache would repeat too."""
    torch.manual_seed(0)
    return widened(model_spec(request.param).build(request.param).eval())


@pytest.mark.parametrize("pieces", [(24,), (10, 1, 1, 12), (1,) * 24, (5, 7, 3, 9)], ids=str)
def test_a_sequence_fed_in_pieces_gives_the_full_forward(model, pieces):
    config = model.config
    x = torch.randint(0, config.vocab_size, (2, config.block_size), generator=torch.Generator().manual_seed(1))
    cache, outputs, start = KVCache(config.block_size), [], 0
    with torch.no_grad():
        full = model(x)
        for size in pieces:
            outputs.append(model(x[:, start : start + size], cache=cache))
            start += size
            assert cache.length == start
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, rtol=0, atol=CACHE_TOLERANCE)


def test_positions_past_the_block_or_the_cache_are_refused(model):
    block = model.config.block_size
    cache = KVCache(block)
    with torch.no_grad():
        model(torch.zeros(1, block - 1, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="block_size"):  # the model's own check, counting the cache
            model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="the cache holds 4 positions; 5 asked"):
            model(torch.zeros(1, 5, dtype=torch.long), cache=KVCache(4))


@pytest.mark.parametrize("prompt_length, new_tokens", [(3, 10), (5, 40)], ids=["within-the-block", "past-the-block"])
def test_greedy_generation_is_the_same_with_and_without_the_cache(model, prompt_length, new_tokens):
    """Past the block (24 positions) the context slides: the last 24 tokens, positions counted from 0 again."""
    config = model.config
    prompt = torch.randint(0, config.vocab_size, (2, prompt_length), generator=torch.Generator().manual_seed(2))
    cached = generate(model, prompt, new_tokens, config.block_size, temperature=0, use_cache=True)
    uncached = generate(model, prompt, new_tokens, config.block_size, temperature=0, use_cache=False)
    assert cached.shape == (2, prompt_length + new_tokens)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, prompt_length:].tolist())) > 1  # not a degenerate repetition of one token


def test_sampling_with_and_without_the_cache_draws_the_same_tokens(model):
    """Same logits (to rounding) and the same generator: the same draws, inside and past the block."""
    config = model.config
    prompt = torch.tensor([[1, 2, 3]])
    runs = [
        generate(model, prompt, 30, config.block_size, 1.0, 10, torch.Generator().manual_seed(3), use_cache)
        for use_cache in (True, False)
    ]
    assert torch.equal(*runs)
