"""A model built on the meta device and materialised shard by shard equals eager initialisation.

Eager initialisation: the GPT built on the CPU, then `model.init_weights(seed)`.
The sharded ranks draw the very same random numbers (each replays every draw on a full-size scratch
tensor and keeps its slice), so the gathered weights must be bit-equal, not merely close; and each
rank must hold only its shards.
"""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from paralm.config.schema import Config
from paralm.models.gpt2 import GPT
from paralm.parallel.parallelize import parallelize
from paralm.parallel.runtime import init_runtime, shutdown
from tests.helpers import tiny_config
from tests.multiprocess import run_ranks


def materialised(config: Config) -> tuple[dict[str, torch.Tensor], int]:
    """The full initial weights of the trainer's meta-device path, and how many elements this rank holds."""
    runtime = init_runtime(config.parallel, config.sync)
    with torch.device("meta"):
        model = GPT(config.model)
    parallelize(model, runtime, config)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    weights = {name: tensor.detach().clone() for name, tensor in full.items()}
    shutdown(runtime)
    return weights, held


def eager(config: Config) -> dict[str, torch.Tensor]:
    model = GPT(config.model)
    model.init_weights(config.train.seed)
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "parallel", "copies"),
    [(1, {}, 1), (2, {"zero": 3}, 1), (2, {"zero": 1}, 2), (4, {"zero": 3, "dp_replicate": 2, "dp_shard": 2}, 2)],
)
def test_meta_init_equals_eager_init(ranks, parallel, copies, tmp_path):
    config = tiny_config(tmp_path, parallel=parallel)
    reference = eager(config)
    results = [materialised(config)] if ranks == 1 else run_ranks(materialised, ranks, tmp_path, config)
    for weights, _ in results:
        assert weights.keys() == reference.keys()
        for name, expected in reference.items():
            assert torch.equal(weights[name], expected), name
        assert torch.equal(weights["lm_head.weight"], weights["wte.weight"])  # still tied
    total = sum(p.numel() for p in GPT(config.model).parameters())
    assert sum(held for _, held in results) == copies * total  # sharded ranks hold 1/N each, replicas repeat it
