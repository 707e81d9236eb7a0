"""Model-state memory: the ZeRO paper's predictions, and one process measured against them.

Peak memory on CPU is the process's peak RSS, most of which is torch itself (hundreds of MiB): it is
checked by the difference between two fresh processes that differ only in depth, where the deeper
model's extra parameters, gradients and AdamW moments (50 MB) must raise the peak by about as much:
between 0.5 and 1.5 times (0.76 to 1.10 measured: the shallow run's peak varies by
16 MB between runs), the rest being the extra layers' activations and the optimizer's temporaries."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paralm.data.prepare import dataset_dir
from paralm.load_config import load_config
from paralm.train.memory import StateBytes, ZeroPrediction
from paralm.train.trainer import train
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


ROOT = Path(__file__).resolve().parents[2]


def _states_and_peak(run_dir: Path, n_layer: int) -> tuple[int, int]:
    """A fresh process trains one step: the model states it counted and its peak memory."""
    args = [f"--model.n_layer={n_layer}", "--model.d_model=256", "--model.n_head=4", "--model.block_size=32"]
    args += ["--train.micro_batch_size=4", "--train.steps=1", "--log.tensorboard=false", f"--run.dir={run_dir}"]
    command = [sys.executable, "-m", "paralm", "train", "--config", str(ROOT / "configs/tiny.toml"), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert result.returncode == 0, result.stderr
    row = read_metrics(run_dir)[-1]
    return sum(row[k] for k in ("param_bytes", "grad_bytes", "optim_bytes")), row["peak_mem_bytes"]


@pytest.mark.slow
def test_peak_memory_grows_by_the_model_states_a_deeper_model_adds(tmp_path):
    dataset_dir(load_config(ROOT / "configs/tiny.toml").data)  # prepared here: neither run's peak includes it
    _states_and_peak(tmp_path / "warm-up", 1)  # and whatever else a first run caches (e.g. measured peaks)
    shallow_states, shallow_peak = _states_and_peak(tmp_path / "shallow", 1)
    deep_states, deep_peak = _states_and_peak(tmp_path / "deep", 5)
    added = deep_states - shallow_states
    assert added > 40e6  # 4 blocks of 12 x 256^2 fp32 weights, gradients and two AdamW moments
    assert 0.5 * added < deep_peak - shallow_peak < 1.5 * added, (added, deep_peak - shallow_peak)
