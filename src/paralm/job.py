"""A training job: join the process group, then run the trainer's loop or a parameter-server job.

The one place that chooses between them, above both, so the loop knows nothing of the parameter server.
"""

from __future__ import annotations

from paralm.config.schema import Config
from paralm.errors import Interrupted, note_failure
from paralm.observe.run import RunObserver
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.param_server.run import run_parameter_server
from paralm.train.engine import StepEngine
from paralm.train.trainer import Trainer


def train(config: Config, engine_type: type[StepEngine] = StepEngine) -> None:
    """Train as `config` says, on the step engine `engine_type` (the trainer's own, or a wing's: `paralm rl`)."""
    observer = RunObserver(config)  # before the process group: NCCL's flight recorder reads its settings there
    runtime = init_runtime(config.parallel, config.sync)
    try:
        with runtime.counting(config.log.comm_bytes):  # every collective from here on (paralm.parallel.comm_stats)
            if config.sync.mode == "parameter_server":
                run_parameter_server(config, runtime)
            else:
                Trainer(config, runtime, observer, engine_type).fit()
    except Interrupted:
        observer.close()
        shutdown(runtime)  # every rank agreed to stop after the same step: they can leave together
        raise
    except BaseException as error:
        note_failure()  # before leaving the group: its peers fail when it does, and this rank failed first
        observer.failed(error)  # into logs/rank<r>.log; a timed-out collective: hang/rank<r>.txt
        shutdown(runtime, together=False)
        raise
    observer.close()
    shutdown(runtime)
