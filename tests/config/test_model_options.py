"""Each family owns its `[model]` settings: a key the chosen family does not declare is refused in one line naming
the families that have it; MoE's settings, nested in the options (`config.moe.experts`), keep their flat TOML keys
(`moe_experts`); a config file written for another family, or by paralm before families owned their settings
(every field written out), still loads where the keys its family lacks hold their defaults."""

from pathlib import Path

import pytest

from paralm.cli import main
from paralm.config.load import load_config
from paralm.errors import UserError
from paralm.models.config import to_flat
from paralm.models.deepseek import DeepSeekConfig
from paralm.models.gpt2 import GPT2Config
from paralm.models.llama import LlamaConfig
from paralm.models.moe_config import MoEConfig, moe_options
from paralm.models.registry import model_config
from paralm.train.checkpoint.choose import checkpoint_model_config

ROOT = Path(__file__).resolve().parents[2]
DEEPSEEK = ["--model.family=deepseek", "--model.kv_lora_rank=16", "--model.qk_rope_head_dim=8"]

# The [model] section of a run's config.toml as paralm wrote it before each family owned its settings: all 43
# fields, whatever the family (a Llama with MoE feed-forwards here).
OLD_LLAMA_RUN = """
[model]
family = "llama"
n_layer = 2
n_head = 4
d_model = 64
block_size = 32
vocab_size = 256
dropout = 0.0
bias = true
n_kv_heads = 2
rope_theta = 10000.0
norm_eps = 1e-06
ffn_hidden = 96
head_dim = 0
attention_bias = false
qk_norm = false
rope_scaling = "none"
rope_factor = 1.0
rope_low_freq_factor = 1.0
rope_high_freq_factor = 4.0
rope_original_context = 8192
sliding_window = 0
tie_embeddings = false
moe_experts = 4
moe_top_k = 2
moe_norm_topk = true
moe_every = 1
moe_shared_expert = false
moe_score = "softmax"
moe_aux_loss = 0.01
moe_bias_balance = false
moe_bias_rate = 0.001
moe_z_loss = 0.0
moe_first_dense = 0
moe_hidden = 0
moe_routed_scale = 1.0
moe_groups = 1
moe_topk_groups = 1
q_lora_rank = 0
kv_lora_rank = 0
qk_nope_head_dim = 0
qk_rope_head_dim = 0
v_head_dim = 0
moe_capacity = 0.0
"""
# The same run as a GPT-2 with paralm's defaults for every other family's field.
OLD_GPT2_RUN = (
    OLD_LLAMA_RUN.replace('family = "llama"', 'family = "gpt2"')
    .replace("n_kv_heads = 2", "n_kv_heads = 0")
    .replace("norm_eps = 1e-06", "norm_eps = 1e-05")
    .replace("ffn_hidden = 96", "ffn_hidden = 0")
)


@pytest.mark.parametrize(
    "family_args, key, value, owners",
    [
        ([], "qk_norm", "true", 'llama has it: set model.family = "llama"'),
        ([], "rope_scaling", "llama3", 'llama and deepseek have it: set model.family = "llama" or "deepseek"'),
        ([], "q_lora_rank", "8", 'deepseek has it: set model.family = "deepseek"'),
        ([], "ffn_hidden", "64", 'llama and deepseek have it: set model.family = "llama" or "deepseek"'),
        (["--model.family=llama"], "bias", "false", 'gpt2 has it: set model.family = "gpt2"'),
        (["--model.family=llama"], "kv_lora_rank", "16", 'deepseek has it: set model.family = "deepseek"'),
        (DEEPSEEK, "sliding_window", "8", 'llama has it: set model.family = "llama"'),
        (DEEPSEEK, "n_kv_heads", "2", 'llama has it: set model.family = "llama"'),
        (DEEPSEEK, "bias", "true", 'gpt2 has it: set model.family = "gpt2"'),
    ],
)
def test_a_key_the_family_does_not_declare_is_refused_in_one_line(family_args, key, value, owners):
    family = next((a.split("=")[1] for a in family_args if a.startswith("--model.family=")), "gpt2")
    with pytest.raises(UserError) as refused:
        load_config(None, [*family_args, f"--model.{key}={value}"])
    message = str(refused.value)
    assert f"model.{key}: the {family} family has no such field ({owners})" in message and "\n" not in message


def test_the_cli_refuses_it_with_exit_2_and_one_line(tmp_path, capsys):
    code = main(["train", "--model.qk_norm=true", "--train.steps=1", f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert 'model.qk_norm: the gpt2 family has no such field (llama has it: set model.family = "llama")' in err
    assert not (tmp_path / "run").exists()


def test_a_key_no_family_has_is_an_unknown_field_with_a_suggestion():
    with pytest.raises(UserError, match=r"unknown field model.moe_hiden \(did you mean 'moe_hidden'\?\)"):
        load_config(None, ["--model.family=llama", "--model.moe_hiden=3"])


def test_the_family_picks_the_options_class():
    assert type(load_config(None).model) is GPT2Config
    assert type(load_config(ROOT / "configs/llama-tiny.toml").model) is LlamaConfig
    assert type(load_config(ROOT / "configs/deepseek-tiny.toml").model) is DeepSeekConfig


def test_the_builder_takes_flat_keys_and_refuses_another_familys():
    config = model_config("llama", n_kv_heads=2, moe_experts=4, moe_top_k=1)
    assert config == LlamaConfig(n_kv_heads=2, moe=MoEConfig(experts=4, top_k=1))
    assert moe_options(config) is config.moe and moe_options(model_config()) is None
    with pytest.raises(UserError, match="model.bias: the llama family has no such field"):
        model_config("llama", bias=False)


def test_moe_settings_nest_in_the_options_and_round_trip_flat_through_toml(tmp_path):
    overrides = ["--model.moe_experts=4", "--model.moe_top_k=1", "--model.moe_capacity=1.5", "--model.moe_hidden=48"]
    config = load_config(ROOT / "configs/llama-tiny.toml", overrides)
    assert (config.model.moe.experts, config.model.moe.top_k, config.model.moe.capacity) == (4, 1, 1.5)
    assert config.model.moe_hidden == 48  # the experts' width is the family's own field
    text = config.to_toml()
    assert "moe_experts = 4\n" in text and "moe_top_k = 1\n" in text and "moe_capacity = 1.5\n" in text
    assert "[model.moe]" not in text and "\nbias =" not in text  # one flat [model], the family's keys only
    (tmp_path / "config.toml").write_text(text)
    assert load_config(tmp_path / "config.toml") == config
    assert to_flat(config.model)["moe_experts"] == 4 and config.to_dict()["model"]["moe_top_k"] == 1


def test_a_file_for_another_family_loads_under_the_command_lines_family():
    """configs/tiny.toml says `bias = true` (GPT-2's default): under --model.family=llama the key changes nothing and
    is dropped; on the command line it would be refused."""
    assert type(load_config(ROOT / "configs/tiny.toml", ["--model.family=llama"]).model) is LlamaConfig
    with pytest.raises(UserError, match="model.bias: the llama family has no such field"):
        load_config(ROOT / "configs/tiny.toml", ["--model.family=llama", "--model.bias=true"])


@pytest.mark.parametrize("section, family", [(OLD_LLAMA_RUN, "llama"), (OLD_GPT2_RUN, "gpt2")])
def test_a_run_config_written_before_families_owned_their_settings_loads(tmp_path, section, family):
    (tmp_path / "config.toml").write_text(section)
    config = load_config(tmp_path / "config.toml")
    assert config.model.family == family
    assert checkpoint_model_config(tmp_path) == config.model  # a checkpoint's config.toml reads alike
    if family == "llama":
        assert (config.model.n_kv_heads, config.model.ffn_hidden, config.model.norm_eps) == (2, 96, 1e-6)
        assert (config.model.moe.experts, config.model.moe.top_k) == (4, 2)
    else:
        assert config.model == GPT2Config(n_layer=2, n_head=4, d_model=64, block_size=32, moe=MoEConfig(experts=4))


def test_the_old_shared_expert_flag_reads_as_a_count(tmp_path):
    """`moe_shared_expert` (true or false, before DeepSeek-V2's two shared experts) is `moe_shared_experts`."""
    for flag, count in (("true", 1), ("false", 0)):
        (tmp_path / "config.toml").write_text(
            OLD_LLAMA_RUN.replace("moe_shared_expert = false", f"moe_shared_expert = {flag}")
        )
        assert load_config(tmp_path / "config.toml").model.moe.shared_experts == count


def test_an_old_run_config_whose_other_family_key_mattered_is_refused(tmp_path):
    """A GPT-2 run saved with n_kv_heads = 2 (ignored then): the value is no default, so the key is refused."""
    (tmp_path / "config.toml").write_text(OLD_LLAMA_RUN.replace('family = "llama"', 'family = "gpt2"'))
    with pytest.raises(UserError, match="model.n_kv_heads: the gpt2 family has no such field"):
        load_config(tmp_path / "config.toml")
