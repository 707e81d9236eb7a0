"""DeepSeek-V2's and Moonlight's routing against transformers (issue 54): DeepseekV2 folders (softmax scores never
renormalised, top-k `greedy` or `group_limited_greedy` by each group's best score, two shared experts, no balancing
bias) and DeepseekV3 folders shaped as Moonlight-16B-A3B (two shared experts, one group) or without
renormalisation import from sharded folders with transformers' logits, export back sharded to the same tensors,
which transformers loads with the same logits; `checkpoint.init_from` reads them into ep 2 x ZeRO-3 in
`tests/train/checkpoint/test_hf_reads.py`. What transformers' DeepseekV2 computes otherwise than DeepSeek's own code
(`norm_topk_prob = true`), or not at all, is refused in one line.

Odd widths as `tests/models/test_deepseek.py` (3 heads, RoPE part 6), weights far from their initial values
(N(0, 0.3), norms U(0.5, 1.5), V3's balancing bias N(0, 0.2)), so that another top-k method or renormalisation
moves the logits (`test_the_routing_settings_show_in_the_logits`). Tolerance 1e-4, as the issue states.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from paralm.cli import main
from paralm.config.load import load_config
from paralm.errors import UserError
from paralm.models.deepseek_spec import SPEC
from paralm.models.registry import model_config
from paralm.runs import load_trained_model
from tests.hf.test_pretrained import FINE_TUNE, logits_diff, weights
from tests.hf_helpers import LOGIT_TOLERANCE
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import full_parameters, train_looking

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    vocab_size=256, hidden_size=36, intermediate_size=40, moe_intermediate_size=20, num_hidden_layers=3,
    num_attention_heads=3, num_key_value_heads=3, n_routed_experts=8, num_experts_per_tok=3, kv_lora_rank=14,
    qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=10, first_k_dense_replace=1, max_position_embeddings=64,
    q_lora_rank=None, tie_word_embeddings=False,
)  # fmt: skip
CASES = {  # name: (V2 or V3, routing fields)
    "v2-greedy": ("V2", dict(n_shared_experts=2, topk_method="greedy", norm_topk_prob=False)),
    "v2-group-limited": (
        "V2",
        dict(
            n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5
        ),
    ),
    "moonlight": ("V3", dict(n_shared_experts=2, n_group=1, topk_group=1, routed_scaling_factor=2.446)),
    "v3-no-renorm": ("V3", dict(n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=False)),
}


@torch.no_grad()
def far_from_init(version: str, **fields) -> torch.nn.Module:
    """A transformers DeepSeek of `version` with every weight (and V3's bias) moved far from its initial value;
    the same weights for the same shape, whatever the routing fields."""
    torch.manual_seed(0)
    config = getattr(transformers, f"Deepseek{version}Config")(**(SHAPE | fields))
    model = getattr(transformers, f"Deepseek{version}ForCausalLM")(config).eval()
    for name, param in model.named_parameters():
        param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.3)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.2)
    return model


def save_case(path, name: str) -> None:
    version, fields = CASES[name]
    far_from_init(version, **fields).save_pretrained(path, max_shard_size="40KB")


@pytest.mark.parametrize("name", list(CASES))
def test_a_sharded_folder_imports_exactly_and_exports_back(tmp_path, name):
    hf, run, back = tmp_path / "hf", tmp_path / "run", tmp_path / "back"
    save_case(hf, name)
    assert (hf / "model.safetensors.index.json").is_file()
    assert main(["import", "--hf", str(hf), "--out", str(run)]) == 0
    assert logits_diff(hf, run) <= LOGIT_TOLERANCE

    assert main(["export", "--run", str(run), "--out", str(back), "--max-shard-size", "40KB"]) == 0
    assert (back / "model.safetensors.index.json").is_file()
    version, fields = CASES[name]
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == [f"Deepseek{version}ForCausalLM"]
    assert {k: config[k] for k in fields} == fields
    assert logits_diff(back, run) <= LOGIT_TOLERANCE
    original, exported = weights(hf), weights(back)
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)  # weights move without arithmetic


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v2-group-limited", "moonlight"])
def test_init_from_into_ep2_zero3_trains_and_exports(tmp_path, name):
    """`checkpoint.init_from` straight into ep 2 x ZeRO-3 (each rank 4 of the 8 experts, ZeRO-3 sharding them and
    the shared MLP): before the first step the ranks' weights, gathered, are exactly the import's; after 2 steps
    the export computes the run's logits in transformers."""
    hf, run = tmp_path / "hf", tmp_path / "run"
    save_case(hf, name)
    overrides = [*FINE_TUNE, f"--run.dir={run}", "--parallel.ep=2", "--parallel.zero=3", f"--checkpoint.init_from={hf}"]
    config = load_config(None, overrides, init_model=True)
    started = run_ranks(train_looking, 2, tmp_path, config, full_parameters)[0]
    assert main(["import", "--hf", str(hf), "--out", str(tmp_path / "imported")]) == 0
    expected = dict(load_trained_model(tmp_path / "imported").model.named_parameters())
    assert started.keys() == expected.keys() and all(torch.equal(started[k], v) for k, v in expected.items())
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "back")]) == 0
    assert logits_diff(tmp_path / "back", run) <= LOGIT_TOLERANCE
    assert logits_diff(hf, run) > 1e-4  # it trained


def test_the_routing_settings_show_in_the_logits():
    """The same weights under another top-k method (V2: each group's best score or none; V3: renormalised or
    not) give other logits, so the exactness above holds each method apart."""
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    pairs = [
        (("V2", CASES["v2-group-limited"][1]), ("V2", CASES["v2-group-limited"][1] | {"topk_method": "greedy"})),
        (("V3", CASES["v3-no-renorm"][1]), ("V3", CASES["v3-no-renorm"][1] | {"norm_topk_prob": True})),
    ]
    with torch.no_grad():
        for (a, fields_a), (b, fields_b) in pairs:
            diff = (far_from_init(a, **fields_a)(x).logits - far_from_init(b, **fields_b)(x).logits).abs().max()
            assert diff > 1e-2, (fields_a, fields_b)


def test_the_counts_are_transformers_parameters():
    """Two shared experts are one MLP twice an expert's width: the closed-form count is the module's."""
    for name in ("v2-greedy", "moonlight"):
        version, fields = CASES[name]
        theirs = far_from_init(version, **fields)
        config = model_config(**SPEC.hf.config_from_hf(theirs.config.to_dict(), "config.json"))
        assert config.moe.shared_experts == 2
        assert SPEC.shape(config).params == sum(p.numel() for p in theirs.parameters())


@pytest.mark.parametrize(
    "setting, fragment",
    [
        ({"norm_topk_prob": True}, "norm_topk_prob = True, paralm's DeepSeek needs False"),
        ({"topk_method": "noaux_tc"}, "topk_method = 'noaux_tc'; DeepseekV2 routes with 'greedy' or"),
        ({"scoring_func": "sigmoid"}, "scoring_func = 'sigmoid', paralm's DeepSeek needs 'softmax'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq = 2"),
        ({"n_shared_experts": 0}, "n_shared_experts = 0 must be a positive integer"),
    ],
)
def test_what_deepseek_v2_computes_otherwise_is_refused_in_one_line(tmp_path, capsys, setting, fragment):
    hf = tmp_path / "hf"
    save_case(hf, "v2-greedy")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | setting))
    capsys.readouterr()
    assert main(["import", "--hf", str(hf), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err


DEEPSEEK = dict(
    family="deepseek", n_layer=2, n_head=2, d_model=16, kv_lora_rank=8, qk_rope_head_dim=4, moe_experts=4,
    moe_top_k=2, moe_first_dense=1, moe_shared_experts=2,
)  # fmt: skip


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"moe_bias_balance": True}, "model.moe_bias_balance = True: Hugging Face DeepseekV2 needs False"),
        ({"moe_norm_topk": True}, "model.moe_norm_topk = True: Hugging Face DeepseekV2 needs False"),
        ({"moe_groups": 2}, "model.moe_group_score = 'top2': Hugging Face DeepseekV2 needs 'max'"),
        (
            {"moe_score": "sigmoid", "moe_groups": 2, "moe_group_score": "max"},
            "model.moe_group_score = 'max': Hugging Face DeepseekV3 needs 'top2'",
        ),
        ({"moe_shared_experts": 0}, "model.moe_shared_experts = 0: Hugging Face DeepseekV2 needs 1"),
    ],
)
def test_what_neither_architecture_computes_does_not_export(fields, fragment):
    """Softmax scores export as DeepseekV2 (never renormalised, no bias, groups by their best score), sigmoid as
    DeepseekV3 (groups by their top 2); both have shared experts."""
    with pytest.raises(UserError, match=re.escape(fragment)):
        SPEC.hf.config_to_hf(model_config(**(DEEPSEEK | {"moe_norm_topk": False} | fields)))
