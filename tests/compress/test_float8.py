"""FP8 training (`precision.float8`) is refused in one line where the device has no FP8 matmul
(CPUs, GPUs below compute capability 8.9), before any step."""

import pytest
import torch

from paralm.errors import UserError
from paralm.job import train
from tests.helpers import tiny_config


def _has_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(_has_fp8(), reason="this device has FP8: nothing to refuse")
def test_float8_is_refused_without_fp8(tmp_path):
    config = tiny_config(tmp_path / "run", precision={"float8": True})
    with pytest.raises(UserError, match="precision.float8 = true needs"):
        train(config)
    assert not (tmp_path / "run" / "checkpoints").exists()
