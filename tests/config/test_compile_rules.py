"""`train.compile` reads off / blocks / model, and the true / false of earlier configs; the layouts and devices it
cannot compile for, and `train.cuda_graphs` off one GPU, are refused in one line naming the field and the fix."""

import pytest

from paralm.config.compile_rules import check_compile_device
from paralm.config.dims import ParallelDims
from paralm.config.load import load_config
from paralm.config.schema import Config
from paralm.errors import UserError


@pytest.mark.parametrize(
    ("given", "read"),
    [("true", "blocks"), ("True", "blocks"), ("false", "off"), ("blocks", "blocks"), ("model", "model")],
)
def test_compile_reads_its_modes_and_the_booleans_of_earlier_versions_from_the_command_line(given, read):
    assert load_config(None, [f"--train.compile={given}"]).train.compile == read


@pytest.mark.parametrize(("toml", "read"), [("true", "blocks"), ("false", "off"), ('"model"', "model")])
def test_a_saved_config_of_an_earlier_version_loads(tmp_path, toml, read):
    path = tmp_path / "config.toml"
    path.write_text(f"[train]\ncompile = {toml}\n")
    assert load_config(path).train.compile == read


def test_an_unknown_compile_mode_is_refused_naming_the_field_and_the_modes():
    with pytest.raises(UserError, match=r"train.compile = 'everything' is not one of off \| blocks \| model"):
        load_config(None, ["--train.compile=everything"])


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["--parallel.pp=2"], "parallel.pp > 1"),
        (["--parallel.zero=3"], "parallel.zero = 2 or 3"),
        (["--parallel.cp=2", "--parallel.cp_method=alltoall"], "parallel.cp > 1"),
    ],
)
def test_the_whole_model_graph_is_refused_where_the_layout_splits_the_forward(overrides, named):
    with pytest.raises(UserError, match=rf"train.compile = 'model' .*{named}.*use train.compile = 'blocks'"):
        load_config(None, ["--train.compile=model", *overrides])
    load_config(None, ["--train.compile=blocks", *overrides])  # per block it compiles


@pytest.mark.parametrize("mode", ["blocks", "model"])
def test_ring_attention_is_refused_compiled(mode):
    with pytest.raises(UserError, match=rf"train.compile = '{mode}' does not compile ring attention.*alltoall"):
        load_config(None, [f"--train.compile={mode}", "--parallel.cp=2", "--parallel.cp_method=ring"])


@pytest.mark.parametrize(
    ("overrides", "device", "world", "refusal"),
    [
        ([], "cpu", 1, "needs a CUDA GPU, this process runs on cpu"),
        (["--train.compile=model"], "cpu", 1, "needs a CUDA GPU"),
        (["--train.compile=blocks"], "cuda", 1, "set train.compile = 'model'"),
        (["--train.compile=model", "--parallel.zero=1"], "cuda", 2, "runs on one process, this job has 2"),
    ],
)
def test_cuda_graphs_are_refused_off_one_gpu_and_without_the_compiled_step(overrides, device, world, refusal):
    config = load_config(None, ["--train.cuda_graphs=true", *overrides])
    with pytest.raises(UserError, match=refusal):
        _check_device(config, device, world)


def test_cuda_graphs_of_the_compiled_step_on_one_gpu_pass():
    _check_device(load_config(None, ["--train.cuda_graphs=true", "--train.compile=model"]), "cuda", 1)


def test_the_whole_model_graph_is_refused_under_ddp_and_compiles_under_zero_1():
    with pytest.raises(UserError, match=r"train.compile = 'model' does not compile under DDP.*parallel.zero = 1"):
        _check_device(load_config(None, ["--train.compile=model"]), "cpu", 2)
    _check_device(load_config(None, ["--train.compile=model", "--parallel.zero=1"]), "cpu", 2)
    _check_device(load_config(None, ["--train.compile=blocks"]), "cpu", 2)


def _check_device(config: Config, device_type: str, world_size: int) -> None:
    check_compile_device(config, device_type, ParallelDims.from_config(config.parallel, config.sync, world_size))
