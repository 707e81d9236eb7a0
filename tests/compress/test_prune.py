"""`paralm prune`: which weights it removes, and that they stay removed through a fine-tune on 2 ranks.

Magnitude pruning removes exactly round(sparsity · n) weights per layer, the smallest in magnitude.
Structured pruning removes whole units: a pruned unit's input rows and output columns are zero in
every layer of its branch, so rewriting its input rows cannot change the model's output (it would if
the rows and columns did not name the same unit, as for a Llama with grouped-query attention). The
fine-tunes (ZeRO-3 sharding, tensor parallelism) end with every masked weight exactly zero while the
other weights moved; without the masks AdamW moves every weight (checked on one process).
"""

import math

import pytest
import torch

from paralm.compress.prune import magnitude_masks, prune_run, structured_masks
from paralm.config.load import load_config
from paralm.config.schema import CONFIG_FILE
from paralm.convert.layers import branch_layers, linear_names
from paralm.errors import UserError
from paralm.job import train
from paralm.models.registry import model_spec
from paralm.param_server.run import refuse_pruned
from paralm.runs import load_trained_model
from paralm.train.checkpoint.masked import saved_masks
from paralm.train.checkpoint.store import latest_checkpoint
from tests.helpers import tiny_config, widened
from tests.multiprocess import run_ranks

LLAMA = {"family": "llama", "n_head": 4, "n_kv_heads": 2, "ffn_hidden": 64}


def _model(**model):
    config = tiny_config("unused", model=model).model
    torch.manual_seed(0)
    return widened(model_spec(config).build(config)), config


def test_magnitude_removes_the_smallest_weights_of_each_layer():
    model, config = _model()
    names = linear_names(model, model_spec(config))
    masks = magnitude_masks(model, names, 0.3)
    assert len(masks) == len(names) == 2 * 6
    for name, mask in masks.items():
        weight = model.get_parameter(name).abs()
        assert int((~mask).sum()) == round(0.3 * weight.numel())
        assert weight[~mask].max() <= weight[mask].min()


@pytest.mark.parametrize("family", [{}, LLAMA], ids=["gpt2", "llama-gqa"])
def test_structured_pruning_removes_whole_units(family):
    model, config = _model(**family)
    masks = structured_masks(model, 0.5, config)
    with torch.no_grad():
        for name, mask in masks.items():
            model.get_parameter(name).mul_(mask)
    x = torch.randint(0, config.vocab_size, (2, 16))
    before = model(x)
    inputs = {
        f"{prefix}.{name}.{kind}"
        for prefix, branch in branch_layers(model, model_spec(config))
        for name in branch.inputs
        for kind in ("weight", "bias")
    }
    with torch.no_grad():  # rewrite every pruned input row: a pruned unit's output columns ignore it
        for name in inputs & set(masks):
            model.get_parameter(name)[~masks[name]] = 1.0
    assert torch.allclose(model(x), before, atol=1e-6)
    for name, mask in masks.items():
        assert math.isclose((~mask).float().mean().item(), 0.5), name


def _train(config):
    train(config)


def _pruned_run(tmp_path, method: str, model: dict | None = None):
    base = tiny_config(tmp_path / "base", model=model or {})
    train(base)
    out = tmp_path / f"pruned-{method}"
    prune_run(str(base.run.dir), 0.5, method, str(out))
    return out


def _masked_weights_stay_zero(tmp_path, out, parallel: dict):
    start = load_trained_model(out).model.state_dict()
    config = load_config(str(out / CONFIG_FILE), [f"--parallel.{k}={v}" for k, v in parallel.items()])
    config.train.steps = 4
    run_ranks(_train, 2, tmp_path, config)
    end_checkpoint = latest_checkpoint(out)
    assert end_checkpoint.name == "step_000004"
    names = saved_masks(end_checkpoint)  # the masks travel into the fine-tune's checkpoint
    assert names
    end = load_trained_model(out).model.state_dict()
    for name in names:
        pruned = start[name] == 0
        assert pruned.any() and (end[name][pruned] == 0).all(), name
        assert not torch.equal(end[name][~pruned], start[name][~pruned]), name  # training moved the others


@pytest.mark.slow
def test_magnitude_pruned_weights_stay_zero_under_zero3_on_2_ranks(tmp_path):
    _masked_weights_stay_zero(tmp_path, _pruned_run(tmp_path, "magnitude"), {"zero": 3})


@pytest.mark.slow
def test_structured_pruned_llama_stays_pruned_under_tensor_parallelism_on_2_ranks(tmp_path):
    _masked_weights_stay_zero(tmp_path, _pruned_run(tmp_path, "structured", LLAMA), {"tp": 2})


def test_without_masks_an_optimizer_step_moves_pruned_weights(tmp_path):
    """The control for the fine-tunes above: zeros do not stay zero by themselves under AdamW."""
    out = _pruned_run(tmp_path, "magnitude")
    model = load_trained_model(out).model.train()
    name = saved_masks(latest_checkpoint(out))[0]
    pruned = model.get_parameter(name) == 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 16))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    optimizer.step()
    assert pruned.any() and (model.get_parameter(name)[pruned] != 0).all()


def test_bad_requests_are_one_line_errors_and_write_nothing(tmp_path):
    base = tiny_config(tmp_path / "base")
    train(base)
    for sparsity, method, match in (
        (1.5, "magnitude", r"--sparsity 1.5"),
        (-0.1, "magnitude", "--sparsity"),
        (0.5, "random", "--method 'random'"),
    ):
        with pytest.raises(UserError, match=match):
            prune_run(str(base.run.dir), sparsity, method, str(tmp_path / "out"))
    with pytest.raises(UserError, match="does not exist"):
        prune_run(str(tmp_path / "nothing"), 0.5, "magnitude", str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no complete checkpoint"):
        prune_run(str(tmp_path / "empty"), 0.5, "magnitude", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_parameter_server_refuses_a_pruned_run(tmp_path):
    """Its servers step the parameters without the masks: the pruned weights would grow back (seen: all 512
    of a layer's after 4 steps), so a pruned run, or one started from a pruned run, is refused in one line; a
    dense run is not."""
    out = _pruned_run(tmp_path, "magnitude")
    with pytest.raises(UserError, match="pruned run: the parameter server does not keep pruning masks"):
        refuse_pruned(load_config(str(out / CONFIG_FILE), ["--sync.mode=parameter_server"]))
    refuse_pruned(load_config(str(tmp_path / "base" / CONFIG_FILE), ["--sync.mode=parameter_server"]))
    started_from = ["--sync.mode=parameter_server", f"--checkpoint.init_from={out}", f"--run.dir={tmp_path / 'ps'}"]
    with pytest.raises(UserError, match="pruned run: the parameter server does not keep pruning masks"):
        refuse_pruned(load_config(str(tmp_path / "base" / CONFIG_FILE), started_from))


@pytest.mark.parametrize("family", [{}, LLAMA], ids=["gpt2", "llama"])
def test_mixture_of_experts_layers_are_refused_not_skipped(tmp_path, family):
    """An MoE block's experts are weight tensors, not linear layers: every compression path (magnitude and
    structured pruning, quantization, QAT) refuses the model in one line instead of skipping the experts or
    listing layers that are not there, and `paralm prune` writes nothing."""
    model, config = _model(**family, moe_experts=4, moe_top_k=2)
    spec = model_spec(config)
    for compress in (lambda: linear_names(model, spec), lambda: structured_masks(model, 0.5, config)):
        with pytest.raises(UserError, match="do not handle mixture-of-experts layers"):
            compress()
    base = tiny_config(tmp_path / "moe", model={**family, "moe_experts": 4, "moe_top_k": 2})
    base.train.steps = 1
    train(base)
    with pytest.raises(UserError, match="mixture-of-experts"):
        prune_run(str(base.run.dir), 0.5, "magnitude", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
