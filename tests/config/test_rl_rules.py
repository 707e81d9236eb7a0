"""`check_rl`: the `[rl]` settings and the layouts `paralm rl` cannot run are refused up front, one line each
naming the field and the fix; the edges of each range run."""

import pytest

from paralm.config.rl_rules import check_rl
from paralm.config.schema import Config
from paralm.errors import UserError


def config(**fields) -> Config:
    """The default config with `rl.prompts` set and `section.field` values replaced."""
    built = Config()
    for name, value in {"rl.prompts": "prompts.jsonl", **fields}.items():
        section, field = name.split(".")
        setattr(getattr(built, section), field, value)
    return built


EDGES = {
    "rl.group_size": 2,
    "rl.prompts_per_step": 1,
    "rl.max_new_tokens": 1,
    "rl.temperature": 1e-3,
    "rl.top_p": 1.0,
    "rl.clip_low": 0.0,
    "rl.clip_high": 0.0,
    "rl.kl_beta": 0.0,
    "rl.updates_per_rollout": 1,
    "rl.steps": 1,
}


@pytest.mark.parametrize(("name", "value"), EDGES.items())
def test_the_edge_of_each_range_runs(name, value):
    check_rl(config(**{name: value}))


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"rl.prompts": ""}, "rl.prompts is empty"),
        ({"rl.group_size": 1}, "rl.group_size = 1 must be at least 2"),
        ({"rl.updates_per_rollout": 3, "checkpoint.every": 100}, "checkpoint.every = 100 is not a multiple"),
        ({"rl.prompts_per_step": 0}, "rl.prompts_per_step = 0 must be at least 1"),
        ({"rl.max_new_tokens": 0}, "rl.max_new_tokens = 0 must be at least 1"),
        ({"rl.temperature": 0.0}, "rl.temperature = 0.0 must be positive"),
        ({"rl.top_p": 0.0}, "rl.top_p = 0.0 must be in (0, 1]"),
        ({"rl.top_p": 1.5}, "rl.top_p = 1.5 must be in (0, 1]"),
        ({"rl.clip_low": 1.0}, "rl.clip_low = 1.0 must be in [0, 1)"),
        ({"rl.clip_low": -0.1}, "rl.clip_low = -0.1 must be in [0, 1)"),
        ({"rl.clip_high": -0.1}, "rl.clip_high = -0.1 must not be negative"),
        ({"rl.kl_beta": -1.0}, "rl.kl_beta = -1.0 must not be negative"),
        ({"rl.updates_per_rollout": 0}, "rl.updates_per_rollout = 0 must be at least 1"),
        ({"rl.steps": 0}, "rl.steps = 0 must be at least 1"),
        ({"rl.reward_weights": [1.0, 2.0]}, "rl.reward_weights has 2 weights for 1 rl.rewards"),
        ({"rl.rewards": ["format"], "rl.format_pattern": "[a-"}, "rl.format_pattern = '[a-' is not a regular"),
        ({"parallel.pp": 2}, "paralm rl does not run parallel.pp = 2"),
        ({"parallel.cp": 2}, "paralm rl does not run parallel.cp = 2"),
        ({"sync.mode": "parameter_server"}, "sync.mode = parameter_server"),
        ({"sync.mode": "local_sgd"}, "sync.mode = local_sgd"),
        ({"sync.mode": "diloco"}, "sync.mode = diloco"),
        ({"comm.compression": "powersgd"}, "comm.compression = powersgd"),
        ({"sync.fault_tolerant": True}, "sync.fault_tolerant = true"),
        ({"data.document_mask": True}, "data.document_mask = true"),
    ],
)
def test_settings_rl_cannot_run_are_one_line_errors(fields, fragment):
    with pytest.raises(UserError) as e:
        check_rl(config(**fields))
    message = str(e.value)
    assert "\n" not in message and fragment in message
    if message.startswith("paralm rl does not run"):  # a layout: the reason, then the setting that runs
        field = fragment.split(" = ")[0].split()[-1]
        assert f"; set {field} = " in message


def test_a_pattern_is_only_checked_where_format_is_used():
    check_rl(config(**{"rl.format_pattern": "[a-"}))  # rl.rewards = [exact_match]: the pattern is unused
