"""The Llama family: its closed-form counts against the built module, its logits against transformers'
`LlamaForCausalLM`, the Hugging Face mapping both ways (and what it refuses), its config rules, and RoPE's
positions.

Tolerances: paralm's Llama and `LlamaForCausalLM` run the same fp32 operations in the same order (RMSNorm
in fp32, RoPE's `rotate_half` layout, SDPA, SwiGLU), so their logits agree to rounding (about 1e-6 at
these sizes); 1e-4 is the bound the export issue states. Weights move between the two without arithmetic,
so round trips are bit-exact.
"""

from pathlib import Path

import pytest
import torch

from paralm.config.load import load_config
from paralm.errors import UserError
from paralm.models.config import ModelConfig
from paralm.models.llama import Llama
from paralm.models.llama_spec import SPEC
from paralm.models.registry import model_config, model_shape
from tests.helpers import widened

LOGIT_TOLERANCE = 1e-4  # see the module docstring

# MHA (kv heads = heads), GQA (2 query heads per kv head), MQA (one kv head); tied and untied heads;
# Llama's own SwiGLU width rule (ffn_hidden 0) and a given one; head dims 8 and 16
SHAPES = {
    "mha-untied": dict(n_head=4, n_kv_heads=0, d_model=32, tie_embeddings=False),
    "gqa-untied": dict(n_head=4, n_kv_heads=2, d_model=32, ffn_hidden=80, tie_embeddings=False),
    "mqa-tied": dict(n_head=4, n_kv_heads=1, d_model=64, ffn_hidden=96, tie_embeddings=True),
    "gqa-tied-wide-heads": dict(n_head=4, n_kv_heads=2, d_model=64, tie_embeddings=True),
}


def llama_config(**fields) -> ModelConfig:
    base = dict(family="llama", n_layer=2, n_head=4, n_kv_heads=2, d_model=32, block_size=32, vocab_size=96)
    return model_config(**(base | fields))


def llama(config: ModelConfig, wide: bool = False) -> Llama:
    """The model from seed 0; `wide`: its matrices redrawn with std 0.1, where a RoPE base 20x off moves
    the logits by at least 0.3 (at initialisation by 4e-5, under the 1e-4 tolerance)."""
    torch.manual_seed(0)
    model = Llama(config).eval()
    return widened(model) if wide else model


def tokens(config: ModelConfig, batch: int = 2, seq: int | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, config.vocab_size, (batch, seq or config.block_size), generator=generator)


@pytest.mark.parametrize("fields", SHAPES.values(), ids=SHAPES.keys())
def test_parameter_count_matches_the_closed_form(fields):
    config = llama_config(**fields)
    model = llama(config)
    shape = model_shape(config)
    assert shape.params == sum(p.numel() for p in model.parameters())  # a tied head counted once
    # no position table; an untied head's embedding is a lookup, not a matmul
    lookup = 0 if config.tie_embeddings else config.vocab_size * config.d_model
    assert shape.flops_params == shape.params - lookup
    assert shape.n_kv_heads == (config.n_kv_heads or config.n_head)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    assert {tuple(p.shape) for p in matrices} == {(rows, cols) for rows, cols, _ in shape.matrices}
    assert sum(p.numel() for p in matrices) == sum(rows * cols * n for rows, cols, n in shape.matrices)
    assert (model.output.weight is model.tok_embeddings.weight) == config.tie_embeddings


def hf_llama(config: ModelConfig, model: Llama):
    """transformers' `LlamaForCausalLM` of `config`, holding `model`'s weights."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SPEC.hf.config_to_hf(config))).eval()
    missing, unexpected = hf.load_state_dict(SPEC.hf.to_hf(model.state_dict(), config), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_embeddings else set())
    return hf


@pytest.mark.parametrize("fields", SHAPES.values(), ids=SHAPES.keys())
def test_logits_equal_transformers_llama(fields):
    # rope_theta and norm_eps away from their defaults, so a field the mapping dropped would show
    config = llama_config(**fields, rope_theta=500.0, norm_eps=1e-3)
    model = llama(config, wide=True)
    hf = hf_llama(config, model)
    if config.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    x = tokens(config)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=0, atol=LOGIT_TOLERANCE)


@pytest.mark.parametrize("fields", SHAPES.values(), ids=SHAPES.keys())
def test_hugging_face_weights_round_trip_exactly(fields):
    config = llama_config(**fields)
    state = llama(config).state_dict()
    back = SPEC.hf.from_hf(SPEC.hf.to_hf(state, config), config, "test")
    assert back.keys() == state.keys()
    assert all(torch.equal(back[name], value) for name, value in state.items())
    rebuilt = Llama(config)
    rebuilt.load_state_dict(back)
    if config.tie_embeddings:
        assert rebuilt.output.weight is rebuilt.tok_embeddings.weight


def test_a_transformers_llama_config_maps_back_to_the_same_fields():
    transformers = pytest.importorskip("transformers")
    config = llama_config(n_kv_heads=1, ffn_hidden=80, rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=True)
    hf = transformers.LlamaConfig(**SPEC.hf.config_to_hf(config)).to_dict()
    assert model_config(**SPEC.hf.config_from_hf(hf, "test")) == config


def relative(name: str, **fields) -> dict:
    """A small transformers config of `name` ("llama", "mistral", "qwen2", "qwen3") as its `config.json` dict."""
    transformers = pytest.importorskip("transformers")
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    base = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
    )
    return cls[name](**(base | fields)).to_dict()


@pytest.mark.parametrize(
    "name, fields",
    [
        ("mistral", dict(sliding_window=None)),
        ("mistral", dict(sliding_window=32)),  # a window as long as the context restricts nothing
    ],
    ids=["mistral-no-window", "mistral-window-of-the-context"],
)
def test_relatives_that_compute_the_same_function_map(name, fields):
    mapped = SPEC.hf.config_from_hf(relative(name, **fields), "test")
    assert model_config(**mapped) == llama_config(ffn_hidden=80, norm_eps=1e-6)


def test_qwen2_qwen3_and_llama3_scaling_map_to_the_llama_options():
    """Qwen2's q/k/v always have biases; Qwen3 normalises q and k per head (here 12 wide, not 32 / 4);
    Llama 3.1's RoPE scaling keeps its four numbers."""
    assert SPEC.hf.config_from_hf(relative("qwen2"), "test")["attention_bias"] is True
    qwen3 = model_config(**SPEC.hf.config_from_hf(relative("qwen3", head_dim=12), "test"))
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim) == (True, False, 12)
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    rope |= dict(original_max_position_embeddings=8, rope_theta=500000.0)
    llama31 = model_config(**SPEC.hf.config_from_hf(relative("llama", rope_parameters=rope), "test"))
    assert (llama31.rope_scaling, llama31.rope_factor, llama31.rope_original_context) == ("llama3", 8.0, 8)
    for config in (qwen3, llama31):
        assert model_config(**SPEC.hf.config_from_hf(SPEC.hf.config_to_hf(config), "test")) == config


@pytest.mark.parametrize(
    "name, fields, fragment",
    [
        ("qwen2", dict(use_sliding_window=True, sliding_window=16), "sliding_window = 16"),  # Qwen's is per layer
        ("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)), "'dynamic'"),
        ("llama", dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
        # Llama's and Qwen3's attention_bias also puts a bias on the output projection, which paralm lacks
        ("llama", dict(attention_bias=True), "attention_bias = True"),
        ("qwen3", dict(attention_bias=True), "attention_bias = True"),
    ],
    ids=["qwen2-sliding-window", "dynamic-rope", "gelu", "llama-attention-bias", "qwen3-attention-bias"],
)
def test_configs_paralm_does_not_compute_are_refused_in_one_line(name, fields, fragment):
    with pytest.raises(UserError) as refused:
        SPEC.hf.config_from_hf(relative(name, **fields), "folder/config.json")
    message = str(refused.value)
    assert fragment in message and message.startswith("folder/config.json: ") and "\n" not in message


def test_legacy_rope_scaling_maps_or_is_refused():
    """config.json files written by transformers 4 name the scaling `rope_scaling`, with `type` or `rope_type`."""
    legacy = relative("llama") | {"rope_parameters": None, "rope_theta": 10000.0}
    linear = SPEC.hf.config_from_hf(legacy | {"rope_scaling": {"type": "linear", "factor": 2.0}}, "test")
    assert (linear["rope_scaling"], linear["rope_factor"], linear["rope_theta"]) == ("linear", 2.0, 10000.0)
    with pytest.raises(UserError, match="rope_type = 'dynamic'"):
        SPEC.hf.config_from_hf(legacy | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "test")
    assert SPEC.hf.config_from_hf(legacy | {"rope_scaling": None}, "test")["rope_theta"] == 10000.0


LLAMA_ARGS = ["--model.family=llama", "--model.d_model=32", "--model.n_head=4"]


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["--model.n_kv_heads=3"], ["model.n_kv_heads = 3", "model.n_head = 4"]),
        (["--model.d_model=24", "--model.n_head=8"], ["model.n_head) = 3 must be a positive even"]),
        (["--model.n_kv_heads=1", "--parallel.tp=2"], ["model.n_kv_heads = 1", "parallel.tp = 2"]),
        (["--model.rope_theta=0"], ["model.rope_theta = 0.0 must be positive"]),
    ],
    ids=["kv-heads-do-not-divide-heads", "odd-head-dim", "tp-does-not-divide-kv-heads", "rope-theta"],
)
def test_shapes_llama_cannot_take_are_one_line_config_errors(overrides, fragments):
    with pytest.raises(UserError) as refused:
        load_config(None, [*LLAMA_ARGS, *overrides])
    message = str(refused.value)
    assert all(fragment in message for fragment in fragments) and "\n" not in message, message


def test_the_llama_tiny_config_loads():
    m = load_config(Path(__file__).resolve().parents[2] / "configs/llama-tiny.toml").model
    assert (m.family, m.n_head, m.n_kv_heads, m.tie_embeddings) == ("llama", 4, 2, False)


def test_default_positions_are_zero_based_and_positions_change_the_output():
    """RoPE makes attention depend on positions only through q_pos - k_pos, so shifting all of them by a
    constant leaves the output equal up to rounding (1e-5: fp32's error on logits of about 2, and on the
    larger angles; measured 1e-6), while spacing them differently changes it (by about 0.7)."""
    config = llama_config(n_kv_heads=2)
    model = llama(config, wide=True)
    x = tokens(config, seq=16)
    positions = torch.arange(16)
    with torch.no_grad():
        default = model(x)
        assert torch.equal(default, model(x, positions=positions))
        torch.testing.assert_close(model(x, positions=positions + 40), default, rtol=0, atol=1e-5)
        spread = model(x, positions=2 * positions)
    assert (spread[:, 1:] - default[:, 1:]).abs().max() > 1e-1
    assert torch.equal(spread[:, 0], default[:, 0])  # the first token attends to itself alone


def test_explicit_positions_may_go_past_the_block_but_implicit_ones_may_not():
    config = llama_config()
    model = llama(config)
    x = tokens(config, batch=1, seq=config.block_size + 1)
    with pytest.raises(ValueError, match="block_size"):
        model(x)
    with torch.no_grad():
        assert model(x[:, :4], positions=torch.arange(60, 64)).shape == (1, 4, config.vocab_size)
