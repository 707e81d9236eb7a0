"""The rewards of completions (`rl.rewards`, weighted by `rl.reward_weights`): the built-ins `exact_match`
and `format`, and the user's `module:function(prompt, completion, answer) -> float`, imported once at the
start so that a name that does not resolve fails before any rollout.

`exact_match` compares final answers: the rest of the line after a text's last `####`, else the content of
its last closed `\\boxed{...}` (nested braces kept), else the whole text; stripped. The same extraction
applies to the `answer`, so GSM8K's answers (the reasoning, then `#### 72`) serve as they are. Two answers
that both read as decimal numbers compare as numbers: "1,000" (commas between groups of three) equals
"1000", "3.0" equals "3", "$5" equals "5", "72." equals "72"; anything else compares as exact text
("1/2" is not "0.5", case counts).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from functools import partial

import torch

from paralm.config.rl import RLConfig
from paralm.config.rl_rules import format_regex, reward_weights
from paralm.errors import UserError
from paralm.rl.prompts import Prompt

RewardFunction = Callable[[str, str, str | None], object]
BUILTINS = ("exact_match", "format")
NEEDS_ANSWER = ("exact_match",)  # the built-ins that read `answer`: every prompt must have one
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+")
_BOXED = "\\boxed{"


@dataclass
class RewardScores:
    total: torch.Tensor  # (n,) float32: the weighted sum over the reward functions
    each: dict[str, torch.Tensor]  # each function's (n,) float32 scores, by its `rl.rewards` entry
    correct: torch.Tensor | None  # (n,) float32 1/0: exact_match's scores where it is used, else None


class Rewards:
    """`rl.rewards` resolved to functions with their weights; scores completions, each against its prompt."""

    def __init__(self, rl: RLConfig) -> None:
        if not rl.rewards:
            raise UserError("rl.rewards is empty: list at least one of exact_match, format or module:function")
        twice = sorted({name for name in rl.rewards if rl.rewards.count(name) > 1})
        if twice:
            raise UserError(f"rl.rewards lists {twice[0]} twice: list it once and weigh it with rl.reward_weights")
        self.names = list(rl.rewards)
        self.weights = reward_weights(rl)
        self.functions = [_resolve(name, rl) for name in self.names]

    def check_prompts(self, prompts: list[Prompt]) -> None:
        """Every prompt has the fields the rewards read (an `answer` for exact_match)."""
        for name in (n for n in self.names if n in NEEDS_ANSWER):
            missing = next((p for p in prompts if p.answer is None), None)
            if missing is not None:
                raise UserError(
                    f"rl.prompts record {missing.index} has no `answer`, which the reward {name} (rl.rewards) "
                    f"compares with: give every record an `answer`, or drop {name} from rl.rewards"
                )

    def score(self, prompts: list[Prompt], completions: list[str]) -> RewardScores:
        """Each function's score of completion i against prompts[i], and their weighted sum."""
        each = {
            name: torch.tensor(
                [_call(name, f, p, c) for p, c in zip(prompts, completions, strict=True)], dtype=torch.float32
            )
            for name, f in zip(self.names, self.functions, strict=True)
        }
        total = torch.zeros(len(completions), dtype=torch.float32)
        for name, weight in zip(self.names, self.weights, strict=True):
            total += weight * each[name]
        return RewardScores(total, each, each.get("exact_match"))


def _call(name: str, function: RewardFunction, prompt: Prompt, completion: str) -> float:
    try:
        value = function(prompt.text, completion, prompt.answer)
    except Exception as e:  # the user's code: whatever it raises stops the run with its name and the prompt
        reason = (str(e).splitlines() or [""])[0]
        raise UserError(
            f"rl.rewards: {name} raised {type(e).__name__} on prompt {prompt.index} ({reason}): fix the function"
        ) from e
    # bool counts as 0/1; None, text, NaN and infinities are refused
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    raise UserError(
        f"rl.rewards: {name} returned {shown} ({type(value).__name__}) for prompt {prompt.index}: "
        "a reward must be a finite number"
    )


def _resolve(name: str, rl: RLConfig) -> RewardFunction:
    if name == "exact_match":
        return exact_match
    if name == "format":
        return partial(_matches, format_regex(rl))
    if ":" not in name:
        raise UserError(
            f"rl.rewards entry {name!r} is not a reward: use {' or '.join(BUILTINS)}, or module:function "
            "for a function of your own"
        )
    return _import(name)


def _import(entry: str) -> RewardFunction:
    """`module:function` (or `module:Class.method`), found as Python finds modules, the working directory
    included: a reward module beside the config works without a PYTHONPATH."""
    module_name, _, attribute = entry.partition(":")
    if not module_name or not attribute:
        raise UserError(f"rl.rewards entry {entry!r} names no module or function: write it as module:function")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # appended: the user's module shadows no installed one
    try:
        target = importlib.import_module(module_name)
    except Exception as e:  # the user's module: a missing file, or anything its import raises
        if isinstance(e, ModuleNotFoundError) and (module_name + ".").startswith(f"{e.name}."):
            fix = f"put {module_name.replace('.', '/')}.py in the working directory or on PYTHONPATH"
        else:
            fix = "fix the module"
        reason = (str(e).splitlines() or [""])[0]
        raise UserError(
            f"rl.rewards entry {entry!r}: module {module_name} does not import ({type(e).__name__}: {reason}): {fix}"
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UserError(f"rl.rewards entry {entry!r}: {module_name} has no {attribute}: name a function in it")
        target = getattr(target, part)
    if not callable(target):
        raise UserError(
            f"rl.rewards entry {entry!r} is a {type(target).__name__}, not a function: name a function "
            "(prompt, completion, answer) -> float"
        )
    try:
        inspect.signature(target).bind("prompt", "completion", "answer")
    except TypeError:
        raise UserError(
            f"rl.rewards entry {entry!r} cannot be called as {attribute}(prompt, completion, answer): "
            "give it those three parameters"
        ) from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    return target


def exact_match(prompt: str, completion: str, answer: str | None) -> float:
    """1.0 where the completion's final answer equals the answer's (as numbers where both are), else 0.0."""
    got, want = final_answer(completion), final_answer(answer or "")
    got_number, want_number = _number(got), _number(want)
    if got_number is not None and want_number is not None:
        return float(got_number == want_number)
    return float(got == want)


def final_answer(text: str) -> str:
    """The answer a text ends with: the rest of the line after the last `####`, else the content of the
    last closed `\\boxed{...}`, else the whole text; stripped."""
    marker, after = text.rpartition("####")[1:]
    if marker:
        return next(iter(after.strip().splitlines()), "").strip()
    boxed = _last_boxed(text)
    return (text if boxed is None else boxed).strip()


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` whose braces close (one cut off by the token limit does not)."""
    start = text.rfind(_BOXED)
    while start >= 0:
        depth, begin = 0, start + len(_BOXED)
        for i in range(begin, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                if depth == 0:
                    return text[begin:i]
                depth -= 1
        start = text.rfind(_BOXED, 0, start)
    return None


def _number(text: str) -> Decimal | None:
    """`text` as a decimal number (a leading `$`, thousands commas and a trailing `.` allowed), else None."""
    text = text.removeprefix("$")
    return Decimal(text.replace(",", "")) if _NUMBER.fullmatch(text) else None


def _matches(pattern: re.Pattern, prompt: str, completion: str, answer: str | None) -> float:
    """The `format` reward: 1.0 where `rl.format_pattern` occurs in the completion."""
    return float(pattern.search(completion) is not None)
