"""The frozen reference policy of the KL term (`rl.kl_beta` > 0): the model RL starts from, on the same layout.

A second copy of the model, parallelized as the policy is (sharded under ZeRO-3 and tensor parallelism, so it
costs each rank what the policy's weights do) and loaded from `checkpoint.init_from`, also on resume: a resumed run
keeps measuring against the same start. Its log-probabilities are computed once per rollout, without gradients.
"""

from __future__ import annotations

import torch

from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.models.registry import model_spec
from paralm.parallel.parallelize import parallelize
from paralm.parallel.runtime import Runtime
from paralm.train.checkpoint.init_from import init_source, load_init


class Reference:
    def __init__(self, config: Config, runtime: Runtime) -> None:
        init_from = init_source(config, None)  # also when the policy resumes from a checkpoint of its own
        if not init_from:
            raise UserError(
                "rl.kl_beta > 0 measures the policy against the model RL starts from: set checkpoint.init_from "
                "(a paralm run or a Hugging Face folder), or rl.kl_beta = 0"
            )
        with torch.device("meta"):
            model = model_spec(config.model).build(config.model)
        plan = parallelize(model, runtime, config)
        load_init(init_from, plan.model, config, runtime.group, None)
        self.model = plan.model.requires_grad_(False).eval()
