"""YaRN RoPE (issue 54) exact against transformers' Llama, Qwen2, Qwen3 and DeepSeek-V3, both ways.

Each folder is saved in shards with YaRN (factor 4 over an original context of 16) and weights moved far from
their initial values; its logits over 48 tokens, three times the original context, are paralm's after
`paralm import` and after `checkpoint.init_from`, and transformers computes them again from `paralm export`'s
folder, whose `rope_parameters` are the original's. DeepSeek twice: the released V3's mscale = mscale_all_dim
= 1 (cos and sin unscaled, the softmax scale times mscale_all_dim's correction squared), and mscale 1 over
mscale_all_dim 0.707 (both factors away from 1). The frequencies themselves: `tests/models/test_rope.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

from paralm.cli import main
from paralm.config.load import load_config
from paralm.errors import UserError
from paralm.models.registry import family_spec, model_config, model_spec
from paralm.runs import load_trained_model
from paralm.train.checkpoint.init_from import load_init
from tests.helpers import read_metrics
from tests.hf_helpers import LOGIT_TOLERANCE
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import full_parameters, train_looking

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}
DENSE = dict(
    vocab_size=256, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=100, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
MLA = dict(
    vocab_size=256, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    intermediate_size=80, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
    qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=64, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)  # fmt: skip
FOLDERS = {  # name: (class, config class, config fields)
    "llama": ("LlamaForCausalLM", "LlamaConfig", DENSE | {"rope_parameters": YARN}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", DENSE | {"rope_parameters": YARN}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", DENSE | {"rope_parameters": YARN}),
    "deepseek-v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        MLA | {"rope_parameters": YARN | {"mscale": 1.0, "mscale_all_dim": 1.0}},
    ),
    "deepseek-mscale": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        MLA | {"rope_parameters": YARN | {"mscale": 1.0, "mscale_all_dim": 0.707}},
    ),
}
TOKENS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))  # past the original 16


def save(path, name: str) -> None:
    cls, config_cls, fields = FOLDERS[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, config_cls)(**json.loads(json.dumps(fields))))
    with torch.no_grad():  # far from init, so a mis-mapped tensor or factor shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, max_shard_size="60KB")


def hf_logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def ours(model) -> torch.Tensor:
    with torch.no_grad():
        return model.float().eval()(TOKENS)


def rope_of(folder) -> dict:
    return transformers.AutoConfig.from_pretrained(folder).rope_parameters


@pytest.mark.parametrize("name", list(FOLDERS))
def test_a_yarn_folder_imports_exactly_and_exports_back(tmp_path, name):
    hf, run, back = tmp_path / "hf", tmp_path / "run", tmp_path / "back"
    save(hf, name)
    assert (hf / "model.safetensors.index.json").is_file()
    assert main(["import", "--hf", str(hf), "--out", str(run)]) == 0
    expected = hf_logits(hf)
    assert (ours(load_trained_model(run).model) - expected).abs().max().item() <= LOGIT_TOLERANCE

    config = load_config(None, [f"--checkpoint.init_from={hf}", f"--run.dir={tmp_path / 'x'}"], init_model=True)
    assert config.model.rope_scaling == "yarn"
    model = model_spec(config.model).build(config.model)
    load_init(str(hf), model, config, None, None)
    assert (ours(model) - expected).abs().max().item() <= LOGIT_TOLERANCE

    assert main(["export", "--run", str(run), "--out", str(back)]) == 0
    assert rope_of(back) == rope_of(hf)
    assert (hf_logits(back) - expected).abs().max().item() <= LOGIT_TOLERANCE


@pytest.mark.parametrize(
    "name, plain", [("qwen3", {"rope_type": "default"}), ("deepseek-mscale", {"mscale_all_dim": 0.0})]
)
def test_yarn_and_its_softmax_factor_change_these_logits(tmp_path, name, plain):
    """Without YaRN (Qwen3), or without DeepSeek's mscale correction (its cos/sin factor and softmax scale), the
    same weights compute other logits at these positions: the exactness above is not vacuous."""
    hf = tmp_path / "hf"
    save(hf, name)
    expected = hf_logits(hf)
    config = json.loads((hf / "config.json").read_text())
    config["rope_parameters"] |= plain
    (hf / "config.json").write_text(json.dumps(config))
    assert (hf_logits(hf) - expected).abs().max().item() > 1e-3


def _config_json(name: str, **rope) -> dict:
    cls, config_cls, fields = FOLDERS[name]
    return getattr(transformers, config_cls)(**fields).to_dict() | rope


@pytest.mark.parametrize("name", ["llama", "deepseek-v3"])
def test_rope_settings_round_trip_and_take_transformers_defaults(name):
    spec = family_spec("deepseek" if "deepseek" in name else "llama")
    original = _config_json(name)
    mapped = spec.hf.config_from_hf(original, "config.json")
    assert spec.hf.config_to_hf(model_config(**mapped))["rope_parameters"] == original["rope_parameters"]
    # transformers 4's legacy key, a Qwen3-style minimal YaRN: beta_fast 32, beta_slow 1; DeepSeek's without a
    # factor: the ratio of the two context lengths
    legacy = original | {"rope_parameters": None, "rope_theta": 500.0}
    legacy["rope_scaling"] = {"type": "yarn", "original_max_position_embeddings": 16}
    fields = spec.hf.config_from_hf(legacy, "config.json")
    assert (fields["rope_theta"], fields["rope_factor"], fields["rope_original_context"]) == (500.0, 4.0, 16)
    assert (fields["rope_beta_fast"], fields["rope_beta_slow"], fields["rope_mscale_all_dim"]) == (32.0, 1.0, 0.0)


@pytest.mark.parametrize("name", ["llama", "deepseek-v3"])
@pytest.mark.parametrize(
    "rope, fragment",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type = 'dynamic'; paralm computes RoPE exactly with"),
        (YARN | {"truncate": False}, "truncate = False; paralm's YaRN rounds its ramp"),
        (YARN | {"attention_factor": 2.0}, "attention_factor = 2.0; paralm derives YaRN's (1.13863)"),
    ],
    ids=["dynamic", "untruncated", "attention-factor"],
)
def test_rope_paralm_does_not_compute_is_refused_in_one_line(name, rope, fragment):
    spec = family_spec("deepseek" if "deepseek" in name else "llama")
    with pytest.raises(UserError) as refused:
        spec.hf.config_from_hf(_config_json(name, rope_parameters=rope | {"rope_theta": 10000.0}), "config.json")
    assert str(refused.value).startswith("config.json: ") and fragment in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_init_from_a_deepseek_yarn_folder_straight_into_ep2_zero3(tmp_path):
    """`checkpoint.init_from` of DeepSeek-V3's YaRN folder into expert parallelism 2 with ZeRO-3: the ranks'
    shards, gathered before the first step, are the weights one process imports; after 2 steps the export
    computes the run's logits in transformers."""
    hf, run = tmp_path / "hf", tmp_path / "run"
    save(hf, "deepseek-mscale")
    overrides = ["--train.steps=2", "--train.micro_batch_size=2", "--train.eval_samples=4", "--log.tensorboard=false"]
    overrides += [f"--run.dir={run}", "--parallel.ep=2", "--parallel.zero=3", f"--checkpoint.init_from={hf}"]
    config = load_config(None, overrides, init_model=True)
    started = run_ranks(train_looking, 2, tmp_path, config, full_parameters)[0]
    assert main(["import", "--hf", str(hf), "--out", str(tmp_path / "imported")]) == 0
    expected = dict(load_trained_model(tmp_path / "imported").model.named_parameters())
    assert started.keys() == expected.keys() and all(torch.equal(started[k], v) for k, v in expected.items())
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "back")]) == 0
    trained = ours(load_trained_model(run).model)
    assert (hf_logits(tmp_path / "back") - trained).abs().max().item() <= LOGIT_TOLERANCE
    assert (hf_logits(hf) - trained).abs().max().item() > 1e-4  # it trained
