"""`paralm export` of a Llama with MoE feed-forwards gives a transformers `MixtralForCausalLM` computing what
paralm's model computes; `paralm import` brings it back, and brings in a Mixtral saved by transformers.
Settings Mixtral does not compute are refused in one line. Tolerances as the other families'
(`tests/hf_helpers.py`): logits within 1e-4, an import of an export bit-identical.
"""

import json

import pytest

from paralm.cli import main
from paralm.job import train
from tests.helpers import tiny_config
from tests.hf_helpers import (
    assert_a_saved_model_imports_with_the_same_logits_and_trains,
    assert_import_is_the_same_model_and_fine_tunes,
    assert_same_logits,
    export,
    save_random,
)

transformers = pytest.importorskip("transformers")

MIXTRAL = {"family": "llama", "n_head": 4, "n_kv_heads": 2, "d_model": 32, "ffn_hidden": 48, "rope_theta": 500.0}
MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_aux_loss": 0.05}


@pytest.fixture(scope="module")
def mixtral_run(tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("export-mixtral") / "run", model=MIXTRAL | MOE, train={"steps": 4})
    train(config)
    return config


def test_export_loads_as_transformers_mixtral_with_the_same_logits(mixtral_run, tmp_path):
    export(mixtral_run.run.dir, tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["MixtralForCausalLM"] and hf["model_type"] == "mixtral"
    assert (hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"]) == (4, 2, 48)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")) is transformers.MixtralForCausalLM
    assert_same_logits(mixtral_run.run.dir, tmp_path / "hf")


def test_import_of_an_export_is_the_same_model_and_fine_tunes(mixtral_run, tmp_path):
    export(mixtral_run.run.dir, tmp_path / "hf")
    assert_import_is_the_same_model_and_fine_tunes(mixtral_run.run.dir, tmp_path / "hf", tmp_path / "imported")


def test_a_random_transformers_mixtral_imports_with_the_same_logits_and_trains(tmp_path):
    config = dict(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    save_random(tmp_path / "mixtral", transformers.MixtralForCausalLM, transformers.MixtralConfig, **config)
    assert_a_saved_model_imports_with_the_same_logits_and_trains(tmp_path / "mixtral", tmp_path / "run")


@pytest.mark.parametrize(
    "model, fragment",
    [
        (MIXTRAL | MOE | {"moe_bias_balance": True}, "model.moe_bias_balance = True"),
        (MIXTRAL | MOE | {"moe_every": 2}, "model.moe_every = 2"),
        ({"moe_experts": 4}, "GPT-2 has no mixture-of-experts"),
    ],
    ids=["loss-free-bias", "dense-blocks", "gpt2"],
)
def test_moe_settings_mixtral_does_not_compute_are_refused_in_one_line(tmp_path, capsys, model, fragment):
    config = tiny_config(tmp_path / "run", model=model, train={"steps": 1})
    train(config)
    capsys.readouterr()
    assert main(["export", "--run", str(config.run.dir), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err
    assert not (tmp_path / "hf").exists()


def test_the_stacked_layout_of_transformers_module_imports_too():
    """Weights as `MixtralForCausalLM.state_dict()` holds them (experts stacked, as paralm's) map as well."""
    import torch

    from paralm.models.llama import Llama
    from paralm.models.llama_spec import SPEC
    from paralm.models.registry import model_config

    torch.manual_seed(0)
    hf_config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    theirs = transformers.MixtralForCausalLM(hf_config).eval()
    assert any(k.endswith("experts.gate_up_proj") for k in theirs.state_dict())
    fields = SPEC.hf.config_from_hf(hf_config.to_dict(), "config.json")
    config = model_config(**fields)
    ours = Llama(config).eval()
    ours.load_state_dict(SPEC.hf.from_hf(theirs.state_dict(), config, "model.safetensors"))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() <= 1e-4
