"""Quantization-aware training (`train.qat = "int8-dynamic"`): what the model trains with is what
`paralm quantize --scheme int8-dynamic` computes.

A QAT run's fake-quantized forward must give the logits of its int8-dynamic quantized model within
0.5 % of the largest logit (measured about 0.1 %, the difference between fake quantization in floating
point and torchao's integer matmul), at least 5 times closer than the unquantized forward of the same
weights (measured about 2.4 %): the weights were trained through the quantization they are deployed
with. Whether that makes the quantized QAT model's loss lower than a plainly trained one's is not
asserted: on tiny models int8 moves the validation loss by 1e-5 (see the issue's note), less than the
difference between the two trainings.
"""

import pytest
import torch

from paralm.compress.qat import apply_qat
from paralm.compress.quantize import quantize_run
from paralm.errors import UserError
from paralm.load_config import load_config
from paralm.models.registry import model_spec
from paralm.runs import load_trained_model
from paralm.train.checkpoint import latest_checkpoint, load_checkpoint
from paralm.train.trainer import train
from tests.helpers import tiny_config

TRAINED_ERROR = 0.005


@pytest.mark.slow
def test_qat_trains_the_forward_that_int8_dynamic_deploys(tmp_path):
    config = tiny_config(tmp_path / "qat", train={"steps": 30, "qat": "int8-dynamic"}, model={"d_model": 64})
    train(config)
    quantize_run(str(config.run.dir), "int8-dynamic", str(tmp_path / "q"))
    spec = model_spec(config.model)
    fake = spec.build(config.model)
    apply_qat(fake, spec, "int8-dynamic")
    load_checkpoint(latest_checkpoint(config.run.dir), fake)
    plain = load_trained_model(config.run.dir).model
    quantized = load_trained_model(tmp_path / "q").model
    x = torch.randint(0, config.model.vocab_size, (4, 32))
    with torch.no_grad():
        deployed = quantized(x)
        scale = deployed.abs().max()
        trained_error = ((fake.eval()(x) - deployed).abs().max() / scale).item()
        float_error = ((plain(x) - deployed).abs().max() / scale).item()
    assert trained_error < TRAINED_ERROR and trained_error < float_error / 5, (trained_error, float_error)


def test_qat_with_tensor_parallelism_is_refused(tmp_path):
    with pytest.raises(UserError, match="train.qat with parallel.tp = 2"):
        load_config(None, [f"--run.dir={tmp_path}", "--train.qat=int8-dynamic", "--parallel.tp=2"])
