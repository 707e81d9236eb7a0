"""`rl.rewards`: exact_match's final answers and number comparison, the `format` regex, the user's
`module:function` imported once (from PYTHONPATH or the working directory), the weighted sum, and every
bad reward refused in one line naming `rl.rewards`, the function and (when scoring) the prompt."""

import math
import sys
import textwrap

import pytest
import torch

from paralm.config.rl import RLConfig
from paralm.errors import UserError
from paralm.rl.prompts import Prompt
from paralm.rl.rewards import Rewards, exact_match, final_answer

REWARDS_MODULE = """
    def length(prompt, completion, answer):
        return len(completion) + 100 * (answer == "a") + 1000 * prompt.startswith("Q")

    def boom(prompt, completion, answer):
        if "bad" in completion:
            raise ValueError("cannot score this\\nsecond line")
        return 1.0

    def returns(prompt, completion, answer):
        return {"none": None, "text": "1", "nan": math.nan, "inf": math.inf, "true": True}[completion]

    def two(prompt, completion):
        return 0.0

    class Scorer:
        @staticmethod
        def half(prompt, completion, answer):
            return 0.5

    CONSTANT = 3
"""


def prompt(index, answer=None, text="Q?"):
    return Prompt(index, [1, 2], text, answer)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of reward functions on sys.path, under a name no other test imports."""
    name = f"user_rewards_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text("import math\n" + textwrap.dedent(REWARDS_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so 3 + 4 = 7\n#### 7", "7"),
        ("#### 1\nthen #### 2 \nQuestion: next", "2"),  # the last marker, up to its line's end
        ("####\n  5\n6", "5"),
        (r"the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),  # nested braces kept
        (r"\boxed{3} then \boxed{4", "3"),  # the last one cut off: the last closed one
        (r"\boxed{1} or \boxed{ {2} }", "{2}"),
        ("  just the text \n", "just the text"),
        (r"#### 9 and \boxed{8}", r"9 and \boxed{8}"),  # #### wins over \boxed
    ],
)
def test_final_answer(text, answer):
    assert final_answer(text) == answer


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("#### 1,000", "1000", 1.0),
        ("#### 3.0", "3", 1.0),
        (r"\boxed{$5}", "5", 1.0),
        ("#### 72.", "72", 1.0),
        ("#### -0.50", "-.5", 1.0),
        ("#### 12,34", "1234", 0.0),  # not thousands groups: compared as text
        ("#### 1/2", "0.5", 0.0),
        ("#### Paris", "paris", 0.0),
        ("#### Paris", " Paris ", 1.0),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "48 + 24 = 72\n#### 72", 1.0),  # GSM8K's answer as it is
        ("#### 71", "#### 72", 0.0),
        ("so #### Paris", "the capital\n#### Paris", 1.0),  # the answer's own final answer, as text
        ("72", "72", 1.0),
    ],
)
def test_exact_match(completion, answer, score):
    assert exact_match("Q?", completion, answer) == score


def test_format_rewards_the_pattern_and_a_bad_pattern_is_refused():
    rewards = Rewards(RLConfig(rewards=["format"]))
    scores = rewards.score([prompt(0), prompt(1), prompt(2)], ["so #### 5", "5", "####"])
    assert scores.each["format"].tolist() == [1.0, 0.0, 0.0] and scores.correct is None
    custom = Rewards(RLConfig(rewards=["format"], format_pattern=r"^<think>.*</think>"))
    assert custom.score([prompt(0), prompt(1)], ["<think>x</think> 5", "5 <think>x</think>"]).total.tolist() == [1, 0]
    with pytest.raises(UserError, match=r"^rl\.format_pattern = '\(' is not a regular expression"):
        Rewards(RLConfig(rewards=["format"], format_pattern="("))


def test_weighted_sum_per_function_scores_and_accuracy(user_module):
    entry = f"{user_module}:length"
    rewards = Rewards(RLConfig(rewards=["exact_match", "format", entry], reward_weights=[2.0, 0.5, -0.25]))
    assert rewards.names == ["exact_match", "format", entry]
    prompts = [prompt(0, "4"), prompt(1, "a", text="R?"), prompt(2, "9")]
    completions = ["#### 4", "no", "#### 8"]
    scores = rewards.score(prompts, completions)
    exact = [1.0, 0.0, 0.0]
    form = [1.0, 0.0, 1.0]
    length = [len(completions[0]) + 1000, 2 + 100, len(completions[2]) + 1000]
    assert scores.each["exact_match"].tolist() == exact and scores.each["format"].tolist() == form
    assert scores.each[entry].tolist() == length
    expected = [2.0 * e + 0.5 * f - 0.25 * n for e, f, n in zip(exact, form, length, strict=True)]
    assert torch.allclose(scores.total, torch.tensor(expected)) and scores.total.dtype == torch.float32
    assert scores.correct.tolist() == exact
    unweighted = Rewards(RLConfig(rewards=["exact_match", "format"])).score(prompts, completions)
    assert unweighted.total.tolist() == [e + f for e, f in zip(exact, form, strict=True)]


def test_a_module_in_the_working_directory_imports(tmp_path, monkeypatch):
    name = f"cwd_rewards_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text("def one(prompt, completion, answer):\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        assert Rewards(RLConfig(rewards=[f"{name}:one"])).score([prompt(0)], ["x"]).total.tolist() == [1.0]
    finally:
        sys.modules.pop(name, None)


def test_prompts_without_the_answer_exact_match_needs_are_refused():
    prompts = [prompt(0, "1"), prompt(1), prompt(2)]
    with pytest.raises(UserError, match=r"^rl\.prompts record 1 has no `answer`, which the reward exact_match"):
        Rewards(RLConfig(rewards=["format", "exact_match"])).check_prompts(prompts)
    Rewards(RLConfig(rewards=["format"])).check_prompts(prompts)  # nothing reads the answer


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ("exactmatch", "is not a reward: use exact_match or format, or module:function"),
        ("no_such_reward_module:f", "does not import (ModuleNotFoundError"),
        ("{module}:missing", "has no missing"),
        ("{module}:CONSTANT", "is a int, not a function"),
        ("{module}:two", "cannot be called as two(prompt, completion, answer)"),
        ("{module}:", "names no module or function"),
    ],
)
def test_rewards_that_do_not_resolve_are_refused_at_the_start(user_module, entry, fragment):
    entry = entry.format(module=user_module)
    with pytest.raises(UserError) as e:
        Rewards(RLConfig(rewards=["exact_match", entry]))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"rl.rewards entry {entry!r}") and fragment in message
    if "ModuleNotFoundError" in fragment:
        assert "working directory or on PYTHONPATH" in message


def test_a_module_that_fails_to_import_says_to_fix_it(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="No module named 'no_such_dependency_xyz'\\): fix the module$"):
        Rewards(RLConfig(rewards=["broken_rewards:f"]))


def test_the_list_and_its_weights_are_checked(user_module):
    assert Rewards(RLConfig(rewards=[f"{user_module}:Scorer.half"])).score([prompt(0)], ["x"]).total.tolist() == [0.5]
    for rl, fragment in (
        (RLConfig(rewards=[]), "rl.rewards is empty"),
        (RLConfig(rewards=["format", "format"]), "rl.rewards lists format twice"),
        (RLConfig(rewards=["format"], reward_weights=[1.0, 2.0]), "rl.reward_weights has 2 weights for 1 rl.rewards"),
    ):
        with pytest.raises(UserError, match=fragment):
            Rewards(rl)


def test_a_reward_that_raises_names_itself_and_the_prompt(user_module):
    rewards = Rewards(RLConfig(rewards=[f"{user_module}:boom"]))
    with pytest.raises(UserError) as e:
        rewards.score([prompt(4), prompt(7)], ["fine", "bad one"])
    assert str(e.value) == (
        f"rl.rewards: {user_module}:boom raised ValueError on prompt 7 (cannot score this): fix the function"
    )


@pytest.mark.parametrize("returned", ["none", "text", "nan", "inf"])
def test_a_reward_that_returns_no_number_is_refused(user_module, returned):
    rewards = Rewards(RLConfig(rewards=[f"{user_module}:returns"]))
    with pytest.raises(UserError) as e:
        rewards.score([prompt(0), prompt(5)], ["true", returned])
    message = str(e.value)
    assert "\n" not in message and f"{user_module}:returns returned" in message and "for prompt 5" in message


def test_a_bool_reward_counts_as_one_or_zero(user_module):
    scores = Rewards(RLConfig(rewards=[f"{user_module}:returns"])).score([prompt(0)], ["true"])
    assert scores.total.tolist() == [1.0] and not math.isnan(scores.total[0])
