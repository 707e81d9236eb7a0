import dataclasses
from pathlib import Path

import pytest

from paralm.config.load import load_config
from paralm.config.schema import Config
from paralm.config.source import parse_overrides
from paralm.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_overrides_are_typed_and_applied_over_the_file():
    config = load_config(
        ROOT / "configs/tiny.toml",
        ["--train.steps=7", "--model.dropout", "0.2", "--log.tensorboard=false", "--train.lr=3e-4"],
    )
    assert config.train.steps == 7 and config.model.dropout == 0.2
    assert config.log.tensorboard is False and config.train.lr == 3e-4


def test_the_tiny_config_file_spells_out_the_defaults():
    assert load_config(ROOT / "configs/tiny.toml") == Config()


def test_gpt2_124m_config_describes_gpt2_small():
    m = load_config(ROOT / "configs/gpt2-124m.toml").model
    assert (m.n_layer, m.n_head, m.d_model, m.block_size) == (12, 12, 768, 1024)
    assert m.vocab_size >= 50257


def test_resolved_config_round_trips_through_toml(tmp_path):
    config = load_config(None, ["--parallel.pp_split=1,3", '--run.dir=a "quoted" dir'])
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml())
    assert load_config(path) == config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--train.no_such_field=1"], "unknown field train.no_such_field"),
        (["--train.stpes=1"], "did you mean 'steps'"),
        (["--train.steps=abc"], "train.steps expects an integer"),
        (["--model.bias=maybe"], "model.bias expects true or false"),
        (["--precision.dtype=fp8"], "precision.dtype = 'fp8' is not one of"),
        (["--nosuch.x=1"], "unknown section [nosuch]"),
        (["--model.n_head=3"], "divisible by model.n_head"),
        (["--model.family=gpt5"], "model.family = 'gpt5' is not a model family: use one of gpt2"),
        (["--train.micro_batch_size=0"], "train.micro_batch_size = 0 must be at least 1"),
        (["--train.loss_impl=bogus"], "train.loss_impl = 'bogus' is not one of auto | plain | chunked | fused"),
        (["--train.loss_chunks=0"], "train.loss_chunks = 0 must be at least 1"),
        (["train.steps=3"], "overrides look like --section.field=value"),
        (["--train.steps"], "needs a value"),
        (  # torchft averages on the device: offloaded shards would reach its NCCL group from the host
            ["--sync.fault_tolerant=true", "--sync.ft_groups=2", "--parallel.zero=3", "--parallel.cpu_offload=true"],
            "set parallel.cpu_offload = false",
        ),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(None, overrides)


def test_a_broken_file_is_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_every_field_but_the_models_has_help():
    for name, section in vars(Config()).items():
        if name != "model":  # the model's fields are documented in paralm.models.config.ModelConfig
            for f in dataclasses.fields(section):
                assert f.metadata.get("help"), f"{name}.{f.name} has no help"


def test_parse_overrides_accepts_both_forms():
    assert parse_overrides(["--a.b=1", "--c.d", "2"]) == {"a": {"b": "1"}, "c": {"d": "2"}}
