"""The hang watchdog times the training step only: validation, checkpoint saves and torch's compilation, however
long, write no "stuck" report (the SIGTERM that follows one would end the rank with no checkpoint)."""

import logging
import time
from pathlib import Path

import torch

import paralm.job
from paralm.observe.step_watch import StepWatch
from paralm.train.checkpoint.loop import LoopCheckpoints
from paralm.train.engine import StepEngine
from tests.helpers import tiny_config
from tests.multiprocess import run_ranks

TIMEOUT_S = 0.3
SLOW_S = 0.8  # well past the deadline: the watchdog polls every TIMEOUT_S / 10


def _reported(watch: StepWatch) -> bool:
    return (watch.run_dir / "hang" / "rank0.json").exists()


def _slow_backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
    time.sleep(SLOW_S)  # compiling, as a large model's first step does
    return graph.forward


def test_between_steps_and_while_compiling_the_clock_stops_and_a_stuck_step_still_shows(tmp_path, caplog):
    torch.compile(lambda x: x - 1, backend="eager")(torch.ones(2))  # dynamo's set-up, once per process
    watch = StepWatch(tmp_path, 0, TIMEOUT_S)
    watch.start()
    try:
        watch.step_started(0)
        watch.step_ended()
        time.sleep(SLOW_S)  # validation, a checkpoint save
        watch.step_started(1)
        torch.compile(lambda x: x + 1, backend=_slow_backend)(torch.ones(2))
        assert not _reported(watch)
        watch.step_ended()
        watch.step_started(2)
        deadline = time.monotonic() + 10 * SLOW_S
        while not _reported(watch) and time.monotonic() < deadline:  # the step itself is still watched
            time.sleep(0.05)
        assert _reported(watch)
        with caplog.at_level(logging.WARNING):
            watch.step_ended()
        assert not _reported(watch)  # it ended: slow, not hung
        assert "step 2 went on longer than parallel.timeout_s = 0.3 s, then ended" in caplog.text
    finally:
        watch.close(finished=True)


def _train_slowly(config) -> list[bool]:
    """One rank (its own process: the run's process group and watchdog stay out of the test process): evaluation
    and checkpoint saves made slow; whether a "stuck" report is on disk as each slow section ends."""
    seen, report = [], Path(config.run.dir) / "hang" / "rank0.json"

    def slowly(work):
        def run(*args, **kwargs):
            time.sleep(SLOW_S)
            seen.append(report.exists())
            return work(*args, **kwargs)

        return run

    StepEngine.evaluate = slowly(StepEngine.evaluate)
    LoopCheckpoints.save = slowly(LoopCheckpoints.save)
    paralm.job.train(config)  # the last step evaluates and saves, then the run ends
    return seen


def test_a_slow_validation_and_checkpoint_save_leave_no_report_and_the_run_ends(tmp_path):
    config = tiny_config(
        tmp_path / "run", train={"steps": 2}, parallel={"force_distributed": True, "timeout_s": TIMEOUT_S}
    )
    seen = run_ranks(_train_slowly, 1, tmp_path, config)[0]
    assert seen == [False, False]  # a step may be slow on a loaded machine: its report is gone when it ends
