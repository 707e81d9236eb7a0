"""A checkpoint records its model family, and loads only into a config of that family: resuming, evaluating
or generating with another `model.family` is one line naming both, before any tensor is read. A run resumes
with LoRA adapters only a checkpoint that holds them, and without them only one that does not: the other
way is one line saying how to start LoRA from it (a new run with `checkpoint.init_from`)."""

import pytest

import paralm.train.checkpoint.store as checkpoint_module
from paralm.cli import main
from paralm.errors import UserError
from paralm.job import train
from paralm.train.checkpoint.choose import checkpoint_model_config
from paralm.train.checkpoint.store import latest_checkpoint
from tests.helpers import tiny_config

LLAMA = {"family": "llama", "n_kv_heads": 1}


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("family") / "run", train={"steps": 1})
    train(config)
    return config


@pytest.fixture
def no_tensor_read(monkeypatch):
    """Reading a checkpoint's metadata or tensors (both go through this reader) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(checkpoint_module, "SafeFileSystemReader", refuse)


def test_the_checkpoint_records_its_family(gpt2_run):
    path = latest_checkpoint(gpt2_run.run.dir)
    assert 'family = "gpt2"' in (path / "config.toml").read_text()
    assert checkpoint_model_config(path).family == "gpt2"


def test_resuming_with_another_family_is_one_line_naming_both(gpt2_run, no_tensor_read):
    llama = tiny_config(gpt2_run.run.dir, model=LLAMA, train={"steps": 2})
    with pytest.raises(UserError) as refused:
        train(llama)
    message = str(refused.value)
    assert "holds a gpt2 model and this config builds a llama one" in message and "\n" not in message
    assert latest_checkpoint(gpt2_run.run.dir).name == "step_000001"  # nothing written


def test_evaluating_with_another_family_is_one_line_naming_both(gpt2_run, no_tensor_read, capsys):
    overrides = [f"--model.{name}={value}" for name, value in LLAMA.items()]
    assert main(["eval", "--run", str(gpt2_run.run.dir), *overrides]) == 2
    err = capsys.readouterr().err
    assert "model.family = 'gpt2' there, 'llama' here" in err and err.count("\n") == 1, err


def test_resuming_with_other_adapters_than_the_checkpoints_is_one_line(gpt2_run, tmp_path):
    lora = {"lora_rank": 4, "steps": 2}
    with pytest.raises(UserError) as refused:  # LoRA in the plain run's own folder
        train(tiny_config(gpt2_run.run.dir, train=lora))
    path = latest_checkpoint(gpt2_run.run.dir)
    fix = "trained without LoRA and train.lora_rank = 4 would resume it with adapters: start LoRA from it in a new "
    assert fix in str(refused.value) and f"checkpoint.init_from={path}" in str(refused.value)
    assert "\n" not in str(refused.value) and path.name == "step_000001"  # nothing written
    adapted = tiny_config(tmp_path / "lora", train=lora | {"steps": 1}, checkpoint={"init_from": str(path)})
    train(adapted)  # the fix the message gives
    with pytest.raises(UserError, match=r"holds LoRA adapters and train\.lora_rank = 0 would resume it without"):
        train(tiny_config(adapted.run.dir, train={"steps": 2}))


def test_a_checkpoint_evaluates_under_another_attention_kernel(gpt2_run):
    """The kernel (`model.attention_backend`) does not shape the weights: the checkpoint's model is the same."""
    assert main(["eval", "--run", str(gpt2_run.run.dir), "--model.attention_backend=math"]) == 0
