"""The DeepSeek family computes what transformers' `DeepseekV3ForCausalLM` computes, both ways: a random
transformers model (weights and balancing bias far from their initialisation, so a wrong RoPE pairing,
latent norm or routing shows) imports with the same logits and maps back to the tensors its
`save_pretrained` writes; a trained run exports to a folder `AutoModelForCausalLM` loads with the same
logits and imports back bit for bit. Odd widths (RoPE part 6, values 10 wide, 3 heads) on purpose.
Tolerance: the same fp32 operations in another order, ~1e-6; 1e-4 as the other families' exports.
"""

import json

import pytest
import torch

from paralm.cli import main
from paralm.config.rules import validate
from paralm.errors import UserError
from paralm.job import train
from paralm.models.config import to_flat
from paralm.models.deepseek_spec import SPEC
from paralm.models.kv_cache import KVCache
from paralm.models.registry import model_config
from tests.helpers import tiny_config
from tests.hf_helpers import (
    LOGIT_TOLERANCE,
    assert_a_saved_model_imports_with_the_same_logits_and_trains,
    assert_import_is_the_same_model_and_fine_tunes,
    assert_import_refused,
    assert_same_logits,
    export,
)

transformers = pytest.importorskip("transformers")

HF = dict(
    vocab_size=64, hidden_size=36, intermediate_size=40, moe_intermediate_size=20, num_hidden_layers=3,
    num_attention_heads=3, num_key_value_heads=3, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
    topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=14, qk_rope_head_dim=6, qk_nope_head_dim=10,
    v_head_dim=10, first_k_dense_replace=1, max_position_embeddings=32,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)  # fmt: skip
DEEPSEEK = dict(
    family="deepseek", n_layer=3, n_head=4, d_model=32, ffn_hidden=48, moe_hidden=16, q_lora_rank=12,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, moe_experts=4, moe_top_k=2,
    moe_first_dense=1, moe_shared_experts=1, moe_score="sigmoid", moe_groups=2, moe_topk_groups=1,
    moe_routed_scale=2.0, moe_bias_balance=True,
)  # fmt: skip


@torch.no_grad()
def _random_transformers(q_lora_rank: int | None, **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**(HF | fields), q_lora_rank=q_lora_rank)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    for name, param in model.named_parameters():
        param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.3)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("q_lora_rank", [None, 8], ids=["full-query", "low-rank-query"])
def test_a_transformers_deepseek_v3_maps_both_ways_with_the_same_logits(q_lora_rank, tmp_path):
    theirs = _random_transformers(q_lora_rank)
    config = model_config(**SPEC.hf.config_from_hf(theirs.config.to_dict(), "config.json"))
    ours = SPEC.build(config).eval()
    ours.load_state_dict(SPEC.hf.from_hf(theirs.state_dict(), config, "model.safetensors"))
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() <= LOGIT_TOLERANCE
    theirs.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved, exported = load_file(tmp_path / "model.safetensors"), SPEC.hf.to_hf(ours.state_dict(), config)
    assert saved.keys() == exported.keys()
    assert all(torch.equal(saved[k], exported[k]) for k in saved)
    fields = SPEC.hf.config_from_hf(SPEC.hf.config_to_hf(config), "config.json")  # the config maps back too
    assert {k: to_flat(config)[k] for k in fields} == fields


def test_given_head_widths_free_d_model_from_n_head(tmp_path):
    """MLA's heads are qk_nope + qk_rope and v_head_dim wide, not d_model / n_head: 44 wide with 5 heads imports
    from transformers with its logits and trains."""
    shape = dict(hidden_size=44, num_attention_heads=5, num_key_value_heads=5, vocab_size=256)  # bytes' vocabulary
    _random_transformers(None, **shape).save_pretrained(tmp_path / "hf")
    assert_a_saved_model_imports_with_the_same_logits_and_trains(tmp_path / "hf", tmp_path / "run")


def test_a_head_width_left_to_d_model_needs_n_head_to_divide_it(tmp_path):
    shape = {"d_model": 44, "n_head": 5}
    validate(tiny_config(tmp_path / "x", model=DEEPSEEK | shape))
    with pytest.raises(UserError, match=r"model.d_model = 44 must be divisible .*: set model.qk_nope_head_dim, or"):
        validate(tiny_config(tmp_path / "x", model=DEEPSEEK | shape | {"qk_nope_head_dim": 0}))


def test_a_refusal_of_a_config_json_names_it(tmp_path, capsys):
    hf = tmp_path / "hf"
    _random_transformers(None).save_pretrained(hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | {"qk_rope_head_dim": 3}))
    assert_import_refused(hf, tmp_path / "run", capsys, f"{hf / 'config.json'}: model.qk_rope_head_dim = 3 must be")


def test_generation_with_the_cache_matches_the_whole_sequence() -> None:
    """Keys (nope + rope wide) and values (v_head_dim wide) of different widths are kept by the cache."""
    torch.manual_seed(0)
    model = SPEC.build(model_config(**DEEPSEEK, block_size=16)).eval()
    x = torch.randint(0, 256, (2, 10))
    cache = KVCache(16)
    with torch.no_grad():
        whole = model(x)
        steps = [model(x[:, :6], cache=cache)] + [model(x[:, i : i + 1], cache=cache) for i in range(6, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=0, atol=1e-5)


def test_parameter_counts_match_the_model() -> None:
    for extra in ({}, {"q_lora_rank": 0, "tie_embeddings": True, "moe_first_dense": 0}):
        config = model_config(**(DEEPSEEK | extra))
        model = SPEC.build(config)
        assert SPEC.shape(config).params == sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("export-deepseek") / "run", model=DEEPSEEK, train={"steps": 4})
    train(config)
    return config


def test_a_trained_run_exports_and_imports_back(deepseek_run, tmp_path):
    export(deepseek_run.run.dir, tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["model_type"] == "deepseek_v3"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model) is transformers.DeepseekV3ForCausalLM
    biases = [layer.mlp.gate.e_score_correction_bias for layer in model.model.layers[1:]]
    assert max(b.abs().max() for b in biases) > 0  # the trained balancing bias travelled
    assert_same_logits(deepseek_run.run.dir, tmp_path / "hf")
    assert_import_is_the_same_model_and_fine_tunes(deepseek_run.run.dir, tmp_path / "hf", tmp_path / "imported")


def test_what_deepseek_does_not_support_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(UserError, match="n_head"):  # MLA's heads split whole over tp
        validate(tiny_config(tmp_path / "x", model=DEEPSEEK | {"n_head": 2}, parallel={"tp": 4}))
    with pytest.raises(UserError, match="kv_lora_rank"):
        validate(tiny_config(tmp_path / "x", model=DEEPSEEK | {"kv_lora_rank": 0}))
    for setting in ({"scoring_func": "softmax"}, {"moe_layer_freq": 2}, {"rope_scaling": {"rope_type": "dynamic"}}):
        with pytest.raises(UserError, match=next(iter(setting)).replace("rope_scaling", "rope_type")):
            SPEC.hf.config_from_hf({"model_type": "deepseek_v3", **setting}, "config.json")
    # softmax scores export as DeepseekV2, which ranks groups by their best score, not their top 2
    config = tiny_config(tmp_path / "run", model=DEEPSEEK | {"moe_score": "softmax"}, train={"steps": 1})
    train(config)
    capsys.readouterr()
    assert main(["export", "--run", str(config.run.dir), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "model.moe_group_score = 'top2': Hugging Face DeepseekV2 needs 'max'" in err and err.count("\n") == 1, err
