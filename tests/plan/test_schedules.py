import pytest

from paralm.config.rules import microbatch_problem
from paralm.config.schema import PIPELINE_SCHEDULES, Config
from paralm.plan.schedules import SCHEDULES


def test_every_configurable_schedule_has_a_cost_model() -> None:
    assert set(SCHEDULES) == set(PIPELINE_SCHEDULES)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubbles_against_the_papers(p: int) -> None:
    f, b, w = 1.0, 2.0, 1.0  # backward costs twice the forward, half of it weight gradients
    m = 4 * p  # enough micro-batches to fill every schedule
    one_f_one_b = (p - 1) * (f + b)
    assert SCHEDULES["gpipe"].bubble(p, 1, m, f, b, w) == one_f_one_b
    assert SCHEDULES["1f1b"].bubble(p, 1, m, f, b, w) == one_f_one_b
    assert SCHEDULES["interleaved_1f1b"].bubble(p, 2, m, f, b, w) == one_f_one_b / 2
    # Zero bubble (Qi et al. 2024): ZB-H1 is a third of 1F1B when F = B_input = W; ZB-V is zero.
    assert SCHEDULES["interleaved_zero_bubble"].bubble(p, 1, m, f, b, w) == pytest.approx(one_f_one_b / 3)
    assert SCHEDULES["zbv_zero_bubble"].bubble(p, 2, m, f, b, w) == 0.0
    assert 0 < SCHEDULES["dualpipev"].bubble(p, 2, m, f, b, w) < one_f_one_b
    assert SCHEDULES["1f1b"].bubble(1, 1, m, f, b, w) == 0.0
    # Too few micro-batches to fill the pipeline: nothing hides the fill and drain.
    assert SCHEDULES["zbv_zero_bubble"].bubble(p, 2, 1, f, b, w) == one_f_one_b
    assert SCHEDULES["interleaved_1f1b"].bubble(p, 2, p - 1, f, b, w) == one_f_one_b


def test_in_flight_micro_batches() -> None:
    p, m = 4, 16
    assert [SCHEDULES["1f1b"].in_flight(p, m, 1, r) for r in range(p)] == [4, 3, 2, 1]
    assert SCHEDULES["gpipe"].in_flight(p, m, 1, 3) == m
    # Interleaving keeps p (1 + (p-1)/(p v)) micro-batches on the first rank (Korthikanti et al. 4.2.3).
    assert SCHEDULES["interleaved_1f1b"].in_flight(p, m, 2, 0) == pytest.approx(p * (1 + (p - 1) / (p * 2)))
    assert SCHEDULES["1f1b"].in_flight(p, 2, 1, 0) == 2  # never more than there are


def _microbatch_problem(schedule: str, p: int, m: int) -> str | None:
    parallel = {
        "pp": p,
        "pp_schedule": schedule,
        "pp_virtual_stages": SCHEDULES[schedule].chunks[0],
        "pp_microbatches": m,
    }
    config = Config.from_dict({"parallel": parallel, "train": {"micro_batch_size": 27720}, "model": {"n_layer": 24}})
    return microbatch_problem(config)


def test_micro_batch_counts_follow_torch() -> None:
    """The rules the search puts its pipeline micro-batch counts to restate torch's constructors."""
    assert _microbatch_problem("1f1b", 4, 3)  # one micro-batch per rank at least
    assert not _microbatch_problem("gpipe", 4, 3)
    assert _microbatch_problem("interleaved_1f1b", 4, 9)  # 2 rounds of 4 and one left over
    assert not _microbatch_problem("interleaved_1f1b", 4, 8)
    assert _microbatch_problem("dualpipev", 4, 4)  # one per stage: 8
    assert not _microbatch_problem("dualpipev", 4, 8)
