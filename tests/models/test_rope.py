"""RoPE's scaled frequencies and factors against transformers' own (`ROPE_INIT_FUNCTIONS`, DeepSeek's
`yarn_apply_mscale`): YaRN's ramp of frequencies and its attention factor on cos and sin for the Llama
family's head widths and DeepSeek's RoPE part, with and without DeepSeek's `mscale`/`mscale_all_dim`, a
correction range whose rounded ends meet (the ramp's guard against dividing by 0), and DeepSeek's softmax
scale. The model-level parity is `tests/hf/test_yarn.py`."""

from __future__ import annotations

import pytest
import torch

from paralm.errors import UserError
from paralm.models.deepseek import softmax_scale
from paralm.models.deepseek_spec import check as deepseek_check
from paralm.models.llama import rope_frequencies, rope_tables
from paralm.models.llama_spec import check as llama_check
from paralm.models.registry import model_config

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale  # noqa: E402

# (head width, theta, factor, original context, beta_fast, beta_slow, mscale, mscale_all_dim)
CASES = {
    "llama-64": (64, 10000.0, 4.0, 16, 32.0, 1.0, 0.0, 0.0),
    "qwen3-128": (128, 1e6, 4.0, 32768, 32.0, 1.0, 0.0, 0.0),
    "deepseek-v3": (64, 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0),
    "deepseek-v2-lite": (8, 10000.0, 4.0, 16, 32.0, 1.0, 0.707, 0.707),
    "mscale-ratio": (16, 500.0, 8.0, 16, 16.0, 2.0, 1.0, 0.707),  # the cos/sin factor is not 1 here
    "range-meets": (8, 10000.0, 2.0, 16, 32.0, 4.0, 0.0, 0.0),  # both ends of the range round to pair 0
}


def _ours(width, theta, factor, original, fast, slow, mscale, all_dim, family="llama", scaling="yarn"):
    shape = dict(qk_rope_head_dim=width, kv_lora_rank=16) if family == "deepseek" else {}
    return model_config(
        family, d_model=4 * width, n_head=4, rope_theta=theta, rope_scaling=scaling, rope_factor=factor,
        rope_original_context=original, rope_beta_fast=fast, rope_beta_slow=slow, rope_mscale=mscale,
        rope_mscale_all_dim=all_dim, **shape,
    )  # fmt: skip


def _theirs(width, theta, factor, original, fast, slow, mscale, all_dim):
    rope = dict(rope_type="yarn", rope_theta=theta, factor=factor, original_max_position_embeddings=original)
    rope |= dict(beta_fast=fast, beta_slow=slow) | ({"mscale": mscale, "mscale_all_dim": all_dim} if mscale else {})
    return transformers.LlamaConfig(
        hidden_size=4 * width, num_attention_heads=4, head_dim=width, rope_parameters=rope,
        max_position_embeddings=int(original * factor),
    )  # fmt: skip


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_yarn_frequencies_and_attention_factor_are_transformers(case):
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](_theirs(*case))
    config = _ours(*case)
    ours = rope_frequencies(config, case[0])
    torch.testing.assert_close(ours, inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, rope_frequencies(_ours(*case, scaling="none"), case[0]))
    positions = torch.arange(48)
    cos, sin = rope_tables(config, positions, case[0])
    angles = positions[:, None].float() * torch.cat((inv_freq, inv_freq))
    torch.testing.assert_close(cos, angles.cos() * attention_factor, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, angles.sin() * attention_factor, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_deepseek_softmax_scale_is_transformers(case):
    width, *_, mscale, all_dim = case
    config = _ours(*case, family="deepseek")
    rope = _theirs(*case).rope_parameters
    assert softmax_scale(config) == pytest.approx(yarn_apply_mscale(rope, 1.0), rel=1e-12)
    assert (softmax_scale(config) != 1.0) == bool(all_dim)


@pytest.mark.parametrize(
    "fields, fragment",
    [
        (dict(rope_scaling="dynamic"), "model.rope_scaling = 'dynamic': use one of none, linear, llama3, yarn"),
        (dict(rope_scaling="yarn", rope_beta_fast=1.0), "model.rope_beta_fast = 1.0 must exceed"),
        (dict(rope_scaling="yarn", rope_original_context=0), "model.rope_original_context = 0 must be positive"),
        (dict(rope_scaling="yarn", rope_mscale=-1.0), "model.rope_mscale = -1.0 must not be negative"),
    ],
)
@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_bad_rope_settings_are_one_line_in_both_families(family, fields, fragment):
    extra = dict(kv_lora_rank=16, qk_rope_head_dim=8) if family == "deepseek" else {}
    config = model_config(family=family, d_model=32, n_head=4, **extra, **fields)
    with pytest.raises(UserError) as refused:
        (deepseek_check if family == "deepseek" else llama_check)(config)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)
