"""`parallel.force_distributed`: a 1-rank job launched like torchrun takes the distributed code paths
(process group, device mesh, DDP / ZeRO-1 / FSDP), so NCCL's device errors would show on one GPU,
and trains exactly as the plain single process does (one replica: the sync is an identity)."""

import pytest
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from paralm.errors import UserError
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.sync.zero1 import ZeroOne
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.slow


def _fit(config):
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime)
    trainer.fit()
    wrapped = {
        "distributed": dist.is_initialized() and runtime.mesh is not None,
        "ddp": isinstance(trainer.engine.module, DistributedDataParallel),
        "zero1": isinstance(trainer.engine.sync, ZeroOne),
        "fsdp": isinstance(trainer.engine.module, FSDPModule),
    }
    shutdown(runtime)
    return wrapped, [row["loss"] for row in read_metrics(config.run.dir)]


@pytest.mark.parametrize(("zero", "wrapper"), [(0, "ddp"), (1, "zero1"), (2, "fsdp"), (3, "fsdp")])
def test_one_rank_takes_the_distributed_path_and_trains_the_same(tmp_path, zero, wrapper):
    plain = tiny_config(tmp_path / "plain", train={"steps": 3}, parallel={"zero": zero})
    forced = tiny_config(tmp_path / "forced", train={"steps": 3}, parallel={"zero": zero, "force_distributed": True})
    [(plain_paths, plain_losses)] = run_ranks(_fit, 1, tmp_path / "plain", plain)
    [(forced_paths, forced_losses)] = run_ranks(_fit, 1, tmp_path / "forced", forced)
    assert not plain_paths["distributed"] and not plain_paths[wrapper]
    assert forced_paths["distributed"] and forced_paths[wrapper]
    assert forced_losses == pytest.approx(plain_losses, abs=1e-5)


def test_forcing_without_a_launcher_is_a_user_error(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(UserError, match="parallel.force_distributed"):
        config = tiny_config(".", parallel={"force_distributed": True})
        init_runtime(config.parallel, config.sync)
