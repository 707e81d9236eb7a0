"""`paralm export` gives a transformers GPT-2 that computes what paralm's model computes, from a checkpoint of
any layout; `paralm import` brings a transformers GPT-2 back as a run that fine-tunes.

The checks every family's export and import pass, and their tolerance (logits within 1e-4, imports
bit-identical), are in `tests/hf_helpers.py`; Llama's are in `tests/hf/test_export_llama.py`.
"""

import json

import pytest

from paralm.cli import main
from paralm.config.load import load_config
from paralm.data.shards import read_meta
from paralm.data.tokenizer import load_tokenizer
from paralm.generate import generate_from_run
from paralm.hf.export import byte_tokenizer
from paralm.job import train
from paralm.runs import load_trained_model
from tests.helpers import tiny_config
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


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("export") / "run", train={"steps": 6})
    train(config)
    return config.run.dir


def test_export_loads_in_transformers_with_the_same_logits_tokens_and_greedy_text(one_process_run, tmp_path):
    out = tmp_path / "hf"
    export(one_process_run, out)
    assert {p.name for p in out.iterdir()} == EXPORTED_FILES
    assert_same_logits(one_process_run, out)
    assert_byte_tokenizer_and_greedy_text(one_process_run, out)


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_exports_whole(tmp_path):
    config = tiny_config(tmp_path / "tp", parallel={"tp": 2}, train={"steps": 3})
    run_ranks(train_each, 2, tmp_path, [config])
    export(config.run.dir, tmp_path / "hf")
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (exported["n_embd"], exported["vocab_size"]) == (config.model.d_model, config.model.vocab_size)
    assert_same_logits(config.run.dir, tmp_path / "hf")


def test_import_of_an_export_is_the_same_model_and_fine_tunes(one_process_run, tmp_path):
    export(one_process_run, tmp_path / "hf")
    assert_import_is_the_same_model_and_fine_tunes(one_process_run, tmp_path / "hf", tmp_path / "imported")


def _save_random_gpt2(path, **overrides) -> None:
    kwargs = dict(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2, activation_function="gelu")
    save_random(path, transformers.GPT2LMHeadModel, transformers.GPT2Config, **(kwargs | overrides))


def test_a_random_transformers_gpt2_imports_with_the_same_logits_and_trains(tmp_path):
    _save_random_gpt2(tmp_path / "gpt2")
    assert_a_saved_model_imports_with_the_same_logits_and_trains(tmp_path / "gpt2", tmp_path / "run")


def test_the_byte_tokenizer_maps_every_byte_to_itself():
    tokenizer = byte_tokenizer()
    assert sorted(tokenizer.get_vocab().values()) == list(range(256))
    text = "".join(map(chr, range(1, 0x3000, 7)))  # ASCII, Latin, Greek, CJK punctuation: 1- to 3-byte UTF-8
    assert tokenizer.encode(text).ids == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"activation_function": "gelu_new"}, "activation_function = 'gelu_new'"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings = False"),
        ({"n_inner": 48}, "n_inner = 48"),
    ],
)
def test_models_that_do_not_map_are_refused_in_one_line(tmp_path, capsys, change, fragment):
    _save_random_gpt2(tmp_path / "gpt2", **change)
    assert_import_refused(tmp_path / "gpt2", tmp_path / "run", capsys, fragment)


def test_weights_without_biases_are_refused(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    _save_random_gpt2(tmp_path / "gpt2")
    weights = load_file(tmp_path / "gpt2" / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.endswith(".bias")}, tmp_path / "gpt2" / "model.safetensors")
    assert main(["import", "--hf", str(tmp_path / "gpt2"), "--out", str(tmp_path / "run")]) == 2
    assert "no biases" in capsys.readouterr().err


def test_bad_run_or_out_is_one_line_and_writes_nothing(one_process_run, tmp_path, capsys):
    assert main(["export", "--run", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    assert main(["export", "--run", str(one_process_run), "--out", str(occupied)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in occupied.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["occupied"]


@pytest.mark.slow
def test_a_bpe_run_exports_its_tokenizer_and_imports_with_its_data(tmp_path):
    bpe = {"tokenizer": "bpe", "bpe_vocab_size": 320}
    config = tiny_config(tmp_path / "bpe", data=bpe, model={"vocab_size": 320}, train={"steps": 2})
    train(config)
    export(config.run.dir, tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = load_trained_model(config.run.dir)
    text = "The object's attributes"
    ours_tokenizer = load_tokenizer("bpe", ours.data_dir)
    assert tokenizer(text)["input_ids"] == ours_tokenizer.encode(text) != list(text.encode())
    assert_same_logits(config.run.dir, tmp_path / "hf")

    run = tmp_path / "imported"
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(run)]) == 0
    imported = load_config(run / "config.toml")
    assert imported.data.path == str(run / "data") and read_meta(run / "data")["tokenizer"] == "hf"
    prompt = "The "
    assert generate_from_run(str(run), prompt, 8, 0, 0) == generate_from_run(str(config.run.dir), prompt, 8, 0, 0)
