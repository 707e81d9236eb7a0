"""`paralm quantize`: torchao's CPU schemes on the blocks' linear layers, a folder eval and generate load.

Stated errors, relative to the largest logit of the unquantized model (a trained tiny model with
matrices redrawn from N(0, 0.1), so logits are far from uniform): int8 weight-only (per output channel)
within 2.5 %, int8 dynamic (activations per token as well) within 3 %, int4 weights (groups of 64, one
per row here) with int8 dynamic activations within 45 %: 16 levels per group. Measured with seeds 0-4:
1.7-2.0 %, 2.0-2.5 % and 26-29 %.
The folder's model must reproduce the quantized model in memory exactly (the saved int8 data and
scales are the ones computed), hold int8 weights (int4 values kept one per byte), and be smaller than
the run's checkpoint.
"""

import pytest
import torch

from paralm.compress.quantize import quantize_run
from paralm.convert.layers import linear_names
from paralm.convert.schemes import quantize_layers
from paralm.errors import UserError
from paralm.evaluate import evaluate_run
from paralm.generate import generate_from_run
from paralm.hf.export import export_run
from paralm.job import train
from paralm.models.registry import model_spec
from paralm.runs import load_trained_model
from paralm.runs.quantized import WEIGHTS_FILE
from paralm.train.checkpoint.store import latest_checkpoint
from tests.helpers import tiny_config, widened

ERROR = {"int8-weight": 0.025, "int8-dynamic": 0.03, "int8-dynamic-int4-weight": 0.45}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("base") / "run", model={"d_model": 64})
    train(config)
    return config


@pytest.mark.parametrize("scheme", ERROR)
def test_quantized_logits_within_the_schemes_error(base, tmp_path, scheme):
    run = load_trained_model(base.run.dir)
    spec = model_spec(base.model)
    torch.manual_seed(0)
    widened(run.model)
    x = torch.randint(0, base.model.vocab_size, (2, 32))
    with torch.no_grad():
        reference = run.model(x)
        quantize_layers(run.model, scheme, linear_names(run.model, spec))
        error = (run.model(x) - reference).abs().max() / reference.abs().max()
    assert 0 < error < ERROR[scheme], error
    assert run.model.get_submodule(linear_names(run.model, spec)[0]).weight.qdata.dtype == torch.int8


@pytest.mark.parametrize("scheme", ERROR)
def test_quantized_folder_loads_the_quantized_model_exactly(base, tmp_path, scheme):
    out = tmp_path / scheme
    quantize_run(str(base.run.dir), scheme, str(out))
    loaded = load_trained_model(out)
    fresh = load_trained_model(base.run.dir)
    spec = model_spec(base.model)
    quantize_layers(fresh.model, scheme, linear_names(fresh.model, spec))
    x = torch.randint(0, base.model.vocab_size, (2, 32))
    with torch.no_grad():
        assert torch.equal(loaded.model(x), fresh.model(x))
    checkpoint = latest_checkpoint(base.run.dir)
    size = sum(f.stat().st_size for f in checkpoint.iterdir())
    assert (out / WEIGHTS_FILE).stat().st_size < size / 3  # the checkpoint also holds AdamW's two moments
    result = evaluate_run(str(out))
    assert result.checkpoint == out and result.loss > 0
    assert generate_from_run(str(out), "def ", 4, 0.0, 0).startswith("def ")


def test_loading_refuses_a_tampered_folder(base, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "q"
    quantize_run(str(base.run.dir), "int8-weight", str(out))
    tensors = load_file(str(out / WEIGHTS_FILE))
    tensors.pop(next(name for name in tensors if name.endswith(":qdata")))
    save_file(tensors, str(out / WEIGHTS_FILE))
    with pytest.raises(UserError, match="does not match its config"):
        load_trained_model(out)


def test_bad_requests_are_one_line_errors_and_write_nothing(base, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UserError, match="--scheme 'int3' is not a quantization scheme"):
        quantize_run(str(base.run.dir), "int3", str(out))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="int4-weight needs a CUDA GPU"):
            quantize_run(str(base.run.dir), "int4-weight", str(out))
    with pytest.raises(UserError, match="does not exist"):
        quantize_run(str(tmp_path / "nothing"), "int8-weight", str(out))
    assert not out.exists()
    quantized = tmp_path / "q"
    quantize_run(str(base.run.dir), "int8-weight", str(quantized))
    with pytest.raises(UserError, match="quantized run .* cannot be quantized again"):
        quantize_run(str(quantized), "int8-dynamic", str(out))
    with pytest.raises(UserError, match="cannot be pruned"):
        from paralm.compress.prune import prune_run

        prune_run(str(quantized), 0.5, "magnitude", str(out))
    with pytest.raises(UserError, match="cannot be exported"):
        export_run(str(quantized), str(out))
    assert not out.exists()


def test_int4_weights_need_input_widths_divisible_by_32(tmp_path):
    config = tiny_config(tmp_path, model={"d_model": 48})
    spec = model_spec(config.model)
    model = spec.build(config.model)
    with pytest.raises(UserError, match="groups of 32, 64 or 128 inputs.*take \\[48, 192\\]"):
        quantize_layers(model, "int8-dynamic-int4-weight", linear_names(model, spec))
