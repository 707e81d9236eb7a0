"""`paralm export` of a Llama run gives a transformers `LlamaForCausalLM` that computes what paralm's model
computes, from a checkpoint of any layout; `paralm import` brings it back, and brings in the relatives that
compute the same function (Mistral; its sliding window is `tests/models/test_families.py`'s), refusing the others
in one line.

The checks and their tolerance (logits within 1e-4, imports bit-identical) are the GPT-2 tests' own,
in `tests/hf_helpers.py`.
"""

import json

import pytest

from paralm.config.load import load_config
from paralm.evaluate import evaluate_run
from paralm.job import train
from tests.helpers import read_metrics, tiny_config
from tests.hf_helpers import (
    EXPORTED_FILES,
    assert_a_saved_model_imports_with_the_same_logits_and_trains,
    assert_byte_tokenizer_and_greedy_text,
    assert_import_is_the_same_model_and_fine_tunes,
    assert_import_refused,
    assert_same_logits,
    export,
    save_random,
)
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import train_each

transformers = pytest.importorskip("transformers")

# grouped-query attention (2 query heads per key/value head), and RoPE's base and RMSNorm's epsilon away
# from transformers' defaults, so that a field export or import dropped would change the logits
LLAMA = {
    "family": "llama",
    "n_head": 4,
    "n_kv_heads": 2,
    "d_model": 32,
    "ffn_hidden": 64,
    "rope_theta": 500.0,
    "norm_eps": 1e-6,
}


def llama_run_config(run_dir, tie_embeddings: bool = False, **sections):
    return tiny_config(run_dir, model=LLAMA | {"tie_embeddings": tie_embeddings}, **sections)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def llama_run(request, tmp_path_factory):
    config = llama_run_config(tmp_path_factory.mktemp("export-llama") / "run", request.param, train={"steps": 6})
    train(config)
    return config


def assert_llama_config_json(hf_dir, model) -> None:
    """config.json names transformers' Llama and every field the function depends on."""
    hf = json.loads((hf_dir / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert hf["num_attention_heads"] == model.n_head and hf["num_key_value_heads"] == model.n_kv_heads
    assert hf.get("rope_theta", hf.get("rope_parameters", {}).get("rope_theta")) == model.rope_theta
    assert hf["rms_norm_eps"] == model.norm_eps and hf["tie_word_embeddings"] == model.tie_embeddings
    assert hf["hidden_act"] == "silu" and hf["intermediate_size"] == model.ffn_hidden


def test_export_loads_as_transformers_llama_with_the_same_logits_tokens_and_greedy_text(llama_run, tmp_path):
    out = tmp_path / "hf"
    export(llama_run.run.dir, out)
    assert {p.name for p in out.iterdir()} == EXPORTED_FILES
    assert_llama_config_json(out, llama_run.model)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is transformers.LlamaForCausalLM
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) == (
        llama_run.model.tie_embeddings
    )
    assert_same_logits(llama_run.run.dir, out)
    assert_byte_tokenizer_and_greedy_text(llama_run.run.dir, out)


def test_import_of_an_export_is_the_same_model_with_the_folders_logits_and_fine_tunes(llama_run, tmp_path):
    export(llama_run.run.dir, tmp_path / "hf")
    assert_import_is_the_same_model_and_fine_tunes(llama_run.run.dir, tmp_path / "hf", tmp_path / "imported")


@pytest.mark.slow
@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2, "pp_microbatches": 2}], ids=["tp2", "pp2"])
def test_a_model_parallel_checkpoint_exports_whole(tmp_path, parallel, tie_embeddings):
    """DCP gathers the shards (TP: each rank's heads, one of the two kv heads, half the vocabulary; PP: each
    rank's layer, the tied head's copy on the last stage) into the one-process model, whose logits the export
    must give. That model is the one the ranks trained: its validation loss is the one they logged after
    their last step (within 1e-5: TP's sums round in another order, as in tests/parallel/test_tensor_parallel.py)."""
    config = llama_run_config(tmp_path / "run", tie_embeddings, parallel=parallel, train={"steps": 3})
    run_ranks(train_each, 2, tmp_path, [config])
    logged = read_metrics(config.run.dir)[-1]["val_loss"]
    assert abs(evaluate_run(str(config.run.dir)).loss - logged) < 1e-5
    export(config.run.dir, tmp_path / "hf")
    assert_llama_config_json(tmp_path / "hf", config.model)
    assert_same_logits(config.run.dir, tmp_path / "hf")


SMALL = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def _save(path, name: str, **overrides) -> None:
    classes = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    }
    save_random(path, *classes[name], **(SMALL | overrides))


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1000.0)),
        ("mistral", dict(sliding_window=None)),
        ("mistral", dict(sliding_window=32)),  # as long as the context: it masks nothing
    ],
    ids=["llama-mqa-tied", "mistral-no-window", "mistral-window-of-the-context"],
)
def test_a_random_transformers_model_imports_with_the_same_logits_and_trains(tmp_path, name, overrides):
    _save(tmp_path / name, name, **overrides)
    assert_a_saved_model_imports_with_the_same_logits_and_trains(tmp_path / name, tmp_path / "run")
    # at initialisation attention is nearly uniform, so a wrong RoPE base or epsilon moves logits little
    # (a base 10x off by about 5e-4): the fields are checked themselves
    hf = json.loads((tmp_path / name / "config.json").read_text())
    model = load_config(tmp_path / "run" / "config.toml").model
    assert (model.n_kv_heads, model.norm_eps, model.tie_embeddings) == (
        hf["num_key_value_heads"],
        hf["rms_norm_eps"],
        hf["tie_word_embeddings"],
    )
    assert model.rope_theta == (hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"])


@pytest.mark.parametrize(
    "name, overrides, fragment",
    [
        ("qwen2", dict(use_sliding_window=True, sliding_window=16), "sliding_window = 16"),
        (
            "llama",
            dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
            "rope_type = 'dynamic'",
        ),
        ("llama", dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
    ],
    ids=["qwen2-sliding-window", "dynamic-rope-scaling", "gelu"],
)
def test_relatives_that_do_not_map_are_refused_in_one_line(tmp_path, capsys, name, overrides, fragment):
    _save(tmp_path / name, name, **overrides)
    assert_import_refused(tmp_path / name, tmp_path / "run", capsys, fragment)
