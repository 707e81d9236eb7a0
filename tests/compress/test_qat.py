"""Quantization-aware training (`train.qat`): the model trained with int8 fake quantization loses less
when `paralm quantize` makes it int8 than the model trained without.

Both runs start from the same seed and see the same batches. What is compared is each model's loss
change under quantization (quantized minus unquantized, on 256 validation windows): a plainly trained
model sits where the unquantized loss is low, so quantizing moves it up; the QAT model's latent
weights were trained for the quantized forward, so quantizing moves its loss less (it often falls).
On this config the change was +1.6e-5 for the plain model and -1.6e-5 for the QAT one (and +1e-5 / -5e-6
at 60 steps of a 32-wide model); a QAT that did nothing would give the same change for both.
"""

import pytest

from paralm.compress.quantize import quantize_run
from paralm.errors import UserError
from paralm.evaluate import evaluate_run
from paralm.load_config import load_config
from paralm.train.trainer import train
from tests.helpers import tiny_config

STEPS = 60
WINDOWS = ["--train.eval_samples=256"]


def _quantization_change(run_dir, tmp_path) -> float:
    quantize_run(str(run_dir), "int8-dynamic", str(tmp_path / f"{run_dir.name}-q"))
    plain = evaluate_run(str(run_dir), overrides=WINDOWS).loss
    quantized = evaluate_run(str(tmp_path / f"{run_dir.name}-q"), overrides=WINDOWS).loss
    return quantized - plain


@pytest.mark.slow
def test_qat_loses_less_when_quantized_than_plain_training(tmp_path):
    changes = {}
    for qat in ("none", "int8-dynamic"):
        run_dir = tmp_path / qat
        train_section = {"steps": STEPS, "decay_steps": STEPS, "micro_batch_size": 8, "qat": qat}
        train(tiny_config(run_dir, train=train_section, model={"d_model": 64, "block_size": 64}))
        changes[qat] = _quantization_change(run_dir, tmp_path)
    assert changes["int8-dynamic"] < changes["none"], changes


def test_qat_with_tensor_parallelism_is_refused(tmp_path):
    with pytest.raises(UserError, match="train.qat with parallel.tp = 2"):
        load_config(None, [f"--run.dir={tmp_path}", "--train.qat=int8-dynamic", "--parallel.tp=2"])
