"""Model-state memory: the ZeRO paper's predictions, and one process measured against them.

Peak RSS on CPU is not checked here: most of it is torch and the data (hundreds of MiB, varying by
run and load), so no bound on it would catch a wrong measurement without failing at random."""

import pytest

from paralm.job import train
from paralm.train.memory import StateBytes, ZeroPrediction
from tests.helpers import read_metrics, tiny_config

PSI, N = 1_000_000, 8


@pytest.mark.parametrize(
    ("dtype", "stage", "formula", "bytes_per_param"),
    [  # Rajbhandari et al. 2020, section 3 (K = 12), then the same derivation for fp32 (K = 8)
        ("bf16", 0, "16Ψ", 16),
        ("bf16", 1, "4Ψ + 12Ψ/N", 4 + 12 / N),
        ("bf16", 2, "2Ψ + 14Ψ/N", 2 + 14 / N),
        ("bf16", 3, "16Ψ/N", 16 / N),
        ("fp32", 0, "16Ψ", 16),
        ("fp32", 1, "8Ψ + 8Ψ/N", 8 + 8 / N),
        ("fp32", 2, "4Ψ + 12Ψ/N", 4 + 12 / N),
        ("fp32", 3, "16Ψ/N", 16 / N),
    ],
)
def test_predictions_follow_the_zero_paper(dtype, stage, formula, bytes_per_param):
    prediction = ZeroPrediction(stage, N, PSI, StateBytes.of(dtype, "adamw"))
    assert prediction.formula == formula
    assert prediction.bytes == pytest.approx(bytes_per_param * PSI)


def test_sgd_keeps_no_state_in_fp32_and_a_master_copy_in_mixed_precision():
    assert ZeroPrediction(0, 1, PSI, StateBytes.of("fp32", "sgd")).formula == "8Ψ"
    assert ZeroPrediction(1, N, PSI, StateBytes.of("fp16", "sgd")).formula == "4Ψ + 4Ψ/N"


def test_one_process_holds_what_the_formula_says(tmp_path, capsys):
    config = tiny_config(tmp_path, train={"steps": 1})
    train(config)
    row = read_metrics(config.run.dir)[0]
    assert row["param_bytes"] == row["grad_bytes"]  # fp32 weights and their gradients
    assert row["optim_bytes"] == pytest.approx(2 * row["param_bytes"], rel=1e-3)  # AdamW moments (+ step counters)
    assert "(1.00 x predicted)" in capsys.readouterr().err


def test_muon_keeps_one_slot_on_its_matrices_and_two_on_the_rest():
    """A share f of the parameters with one fp32 momentum buffer, the rest with AdamW's two moments."""
    assert ZeroPrediction(0, 1, PSI, StateBytes.of("fp32", "muon", 0.75)).formula == "13Ψ"  # 8 + 4 (2 - 0.75)
    assert ZeroPrediction(1, N, PSI, StateBytes.of("bf16", "muon", 0.5)).formula == "4Ψ + 10Ψ/N"  # 4 + 4 + 4 (1.5)
    assert StateBytes.of("fp32", "muon", 0.0) == StateBytes.of("fp32", "adamw")


def test_one_process_with_muon_holds_what_the_formula_says(tmp_path, capsys):
    config = tiny_config(tmp_path, train={"steps": 1, "optimizer": "muon"})
    train(config)
    row = read_metrics(config.run.dir)[0]
    assert row["param_bytes"] < row["optim_bytes"] < 2 * row["param_bytes"]  # one buffer on the matrices, two else
    assert "(1.00 x predicted)" in capsys.readouterr().err
