"""A persistent straggler is named from the metrics rows: once, and again only when another rank takes over;
a rank slower in its forward is named under layouts whose forward communicates from the first layer."""

import time

import pytest

import paralm.train.engine
from paralm.job import train
from paralm.models.registry import model_spec
from paralm.observe.stragglers import WINDOW, StragglerWatch, decode, encode, persistent_straggler
from paralm.train.metrics import MetricsLogger
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

SLOWER_S = 0.3  # CPU seconds the slow rank spends more per step


def test_the_encoding_finds_the_slowest_and_the_spread_by_maxima_alone():
    own = {0: 0.05, 1: 0.351234, 2: 0.12}
    codes = [encode(seconds, rank, 3) for rank, seconds in own.items()]
    slowest, neg_fastest = max(c[0] for c in codes), max(c[1] for c in codes)
    assert decode(slowest, neg_fastest, 3) == {"slowest_rank": 1, "step_time_spread": pytest.approx(0.301234)}
    assert decode(slowest, neg_fastest, 1) == {}  # one process: no rows' figures


def _steps(slowest: list[int], spread: float = 0.3, step_s: float = 0.5) -> list[tuple[int, float, float]]:
    return [(rank, spread, step_s) for rank in slowest]


def test_a_rank_slowest_in_most_of_a_full_window_by_a_clear_margin_is_named():
    assert persistent_straggler(_steps([1] * 7 + [0]), 0.1) == (1, 7, pytest.approx(0.3))
    assert persistent_straggler(_steps([1] * 7), 0.1) is None  # the window is not full yet
    assert persistent_straggler(_steps([1, 0] * 4), 0.1) is None  # half is not most
    assert persistent_straggler(_steps([1] * 8, spread=0.05), 0.1) is None  # under the threshold
    assert persistent_straggler(_steps([1] * 8, spread=0.3, step_s=10.0), 0.1) is None  # under 10% of the step
    assert persistent_straggler(_steps([1] * 8), 0.0) is None  # 0 turns the warning off


def test_only_the_steps_with_a_clear_lead_count():
    window = _steps([1] * 5) + _steps([1] * 3, spread=0.01)
    assert persistent_straggler(window, 0.1) == (1, 5, pytest.approx(0.3))
    assert persistent_straggler(_steps([1] * 4) + _steps([1] * 4, spread=0.01), 0.1) is None


def test_the_warning_comes_once_then_again_when_the_straggler_changes():
    watch = StragglerWatch(threshold_s=0.1)
    rows = [{"slowest_rank": r, "step_time_spread": 0.3, "step_time_s": 0.5} for r in [1] * 12 + [2] * 8]
    lines = [(i, line) for i, row in enumerate(rows) if (line := watch.review(row))]
    assert [i for i, _ in lines] == [WINDOW - 1, 16]  # rank 2 is slowest in 5 of the last 8 at row 16
    assert lines[0][1].startswith("warning: rank 1 is the slowest in 8 of the last 8 steps (by 0.30 s on average")
    assert "rank 2 is the slowest in 5 of the last 8" in lines[1][1]
    assert watch.review({"step": 0, "loss": 1.0}) is None  # a single process's rows carry no figures


def _compute(*_: object) -> None:
    """Work on the CPU for `SLOWER_S` of this thread's CPU time, however loaded the machine is."""
    end = time.thread_time() + SLOWER_S
    while time.thread_time() < end:
        pass


def _train_with_rank_1_slower(config) -> list[str]:
    """Rank 1's last block computes longer in every forward, well after the forward's first collective; what
    rank 0's log says."""
    said: list[str] = []

    def parallelize(model, runtime, config):
        plan = parallelize_plainly(model, runtime, config)
        if runtime.rank == 1:
            blocks = model.get_submodule(model_spec(config.model).blocks)
            list(blocks.values())[-1].register_forward_hook(_compute)
        return plan

    with pytest.MonkeyPatch.context() as patch:
        parallelize_plainly = paralm.train.engine.parallelize
        patch.setattr(paralm.train.engine, "parallelize", parallelize)
        patch.setattr(MetricsLogger, "message", lambda self, text: said.append(text))
        train(config)
    return said


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"zero": 3}, {"tp": 2}], ids=["zero3", "tp2"])
def test_a_rank_slower_past_the_first_collective_is_named(tmp_path, parallel):
    config = tiny_config(tmp_path / "run", train={"steps": WINDOW + 1, "micro_batch_size": 2}, parallel=parallel)
    said = run_ranks(_train_with_rank_1_slower, 2, tmp_path, config)[0]
    warnings = [line for line in said if line.startswith("warning: rank")]
    assert warnings and warnings[0].startswith("warning: rank 1 is the slowest in"), said
    spreads = [row["step_time_spread"] for row in read_metrics(config.run.dir)[1:]]
    assert sorted(spreads)[len(spreads) // 2] == pytest.approx(SLOWER_S, abs=0.1)  # the median step's lead
