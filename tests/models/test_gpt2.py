import pytest
import torch

from paralm.models.config import ModelConfig
from paralm.models.gpt2 import GPT
from paralm.models.gpt2_spec import SPEC
from paralm.models.registry import model_config, model_shape
from paralm.models.sampling import generate

CONFIG = model_config(n_layer=2, n_head=4, d_model=32, block_size=16, vocab_size=64)


def gpt(config: ModelConfig = CONFIG) -> GPT:
    torch.manual_seed(0)
    return GPT(config).eval()


def test_changing_a_later_token_never_changes_earlier_logits():
    model = gpt()
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    for t in (0, 5, CONFIG.block_size - 1):
        changed = x.clone()
        changed[:, t] = (changed[:, t] + 1) % CONFIG.vocab_size
        a, b = model(x), model(changed)
        torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
        assert not torch.allclose(a[:, t], b[:, t])  # the changed position itself does see it


def test_parameter_count_matches_the_closed_form():
    c = CONFIG
    d, v, L = c.d_model, c.vocab_size, c.n_layer
    per_block = 4 * (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d  # attn, fc, proj, 2 LNs
    expected = v * d + L * per_block + 2 * d  # tied embedding/head, blocks, final LN
    shape = model_shape(c)
    assert shape.flops_params == expected
    assert shape.params == expected + c.block_size * d == sum(p.numel() for p in gpt().parameters())


def test_flops_per_token_follows_6n_plus_attention():
    c = CONFIG
    shape = model_shape(c)
    assert shape.flops_per_token == 6 * shape.flops_params + 12 * c.n_layer * c.d_model * c.block_size


def test_a_stage_built_alone_initialises_as_the_whole_model():
    """Each parameter draws from its own name's seed, so building some parts gives the same values;
    a head holding its own copy of the tied embedding draws as the embedding."""
    whole = GPT(CONFIG)
    whole.init_weights(7)
    stage = GPT(CONFIG)
    del stage.blocks["0"]
    stage.wte = stage.wpe = None
    stage.lm_head.weight = torch.nn.Parameter(torch.empty_like(stage.lm_head.weight))
    stage.init_weights(7)
    for name, param in stage.named_parameters():
        expected = whole.wte.weight if name == "lm_head.weight" else whole.get_parameter(name)
        assert torch.equal(param, expected), name
    other = GPT(CONFIG)
    other.init_weights(8)
    assert not torch.equal(other.blocks["1"].mlp.fc.weight, whole.blocks["1"].mlp.fc.weight)


def test_no_bias_model_has_no_biases():
    model = gpt(model_config(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=32, bias=False))
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


def test_gpt2_initialisation_scales_residual_projections():
    model = gpt(model_config(n_layer=8, n_head=4, d_model=256, block_size=8, vocab_size=512))
    residual = model.blocks["0"].attn.wo.weight.std().item()
    other = model.blocks["0"].attn.wq.weight.std().item()
    assert other == pytest.approx(0.02, rel=0.05)
    assert residual == pytest.approx(0.02 / (2 * 8) ** 0.5, rel=0.05)
    assert model.lm_head.weight is model.wte.weight


def test_weights_map_exactly_onto_hugging_face_gpt2():
    transformers = pytest.importorskip("transformers")
    model = gpt()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SPEC.hf.config_to_hf(CONFIG))).eval()
    weights = SPEC.hf.to_hf(model.state_dict(), CONFIG)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the embedding
    back = SPEC.hf.from_hf(weights, CONFIG, "test")
    assert all(torch.equal(back[name], value) for name, value in model.state_dict().items())
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-5, atol=1e-5)


def test_greedy_generation_is_deterministic_and_sampling_respects_top_k():
    model = gpt()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = generate(model, prompt, 5, CONFIG.block_size, temperature=0)
    assert greedy.shape == (1, 8) and torch.equal(greedy, generate(model, prompt, 5, CONFIG.block_size, temperature=0))
    assert torch.equal(greedy[:, :3], prompt)
    logits = model(prompt)[:, -1]
    allowed = set(torch.topk(logits, 3).indices[0].tolist())
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        assert generate(model, prompt, 1, CONFIG.block_size, 1.0, top_k=3, generator=g)[0, -1].item() in allowed


def test_sequences_longer_than_the_block_are_rejected():
    with pytest.raises(ValueError, match="block_size"):
        gpt()(torch.zeros(1, CONFIG.block_size + 1, dtype=torch.long))
