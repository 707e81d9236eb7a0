"""docs/rl.md's 2-core example holds together: its data reverses fixed-length words with the held-out words kept
apart, its config's [rl] section resolves its rewards on completions as long as its answers, its own reward
gives partial credit, and its accuracy script scores a run's greedy completions as exact_match does."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from paralm.config.load import load_config
from paralm.config.rl_rules import check_rl
from paralm.job import train
from paralm.rl.prompts import Prompt
from paralm.rl.rewards import Rewards
from paralm.runs import load_trained_model
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/rl"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"rl_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_data_reverses_words_of_one_length_and_keeps_the_held_out_apart(tmp_path):
    _module("make_data").main(tmp_path, words=60, held_out=10, length=4)
    prompts, held_out = _jsonl(tmp_path / "prompts.jsonl"), _jsonl(tmp_path / "heldout.jsonl")
    assert len(prompts) == 60 and len(held_out) == 10
    for record in prompts + held_out:
        word = record["prompt"].removesuffix("=")
        assert len(word) == 4 and record["answer"] == word[::-1]
    assert {r["prompt"] for r in prompts}.isdisjoint(r["prompt"] for r in held_out)
    lines = (tmp_path / "sft.txt").read_text().splitlines()
    assert lines == [r["prompt"] + r["answer"] for r in prompts]


def test_noise_copies_a_share_of_the_sft_lines_and_leaves_the_prompts_right(tmp_path):
    _module("make_data").main(tmp_path, words=400, held_out=0, noise=0.5)
    prompts = _jsonl(tmp_path / "prompts.jsonl")
    copied = [line for line in (tmp_path / "sft.txt").read_text().splitlines() if line[:3] == line[4:]]
    assert 0.4 < len(copied) / 400 < 0.6  # (palindromes, 1 in 676, count as copies too)
    assert all(r["answer"] == r["prompt"][:3][::-1] for r in prompts)


def test_the_config_scores_completions_as_long_as_its_answers(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # where the docs run it: `examples.rl.reverse_reward` imports from there
    config = load_config(EXAMPLE / "reverse.toml")
    check_rl(config)
    _module("make_data").main(tmp_path, words=5, held_out=0)
    answer = _jsonl(tmp_path / "prompts.jsonl")[0]["answer"]
    assert config.rl.max_new_tokens == len(answer)  # bytes have no end of text: the completion is the answer
    rewards = Rewards(config.rl)
    prompt = [Prompt(0, [99, 97, 116, 61], "cat=", "tac")]
    for completion, exact, letters in (("tac", 1.0, 1.0), ("tca", 0.0, 1 / 3), ("xyz", 0.0, 0.0)):
        scores = rewards.score(prompt, [completion])
        assert scores.correct.tolist() == [exact]
        assert scores.each["examples.rl.reverse_reward:letters"].tolist() == pytest.approx([letters])
        assert scores.total.tolist() == pytest.approx([exact + letters])


def test_the_accuracy_is_the_share_of_greedy_completions_that_match(tmp_path):
    config = tiny_config(tmp_path / "run", train={"steps": 1})
    train(config)
    model = load_trained_model(config.run.dir).model
    words = ["cat=", "dog=", "emu=", "fox="]

    def greedy(prompt: str) -> str:  # one token at a time, the whole sequence each step (no cache)
        ids = torch.tensor([list(prompt.encode())])
        with torch.no_grad():
            for _ in range(3):
                ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return bytes(ids[0, len(prompt) :].tolist()).decode("utf-8", errors="replace")

    right = {w: greedy(w) for w in words[:2]}  # answers the model gives, then two it does not
    wrong = {w: "wxyz" for w in words[2:]}  # 4 letters: no 3-byte completion equals them
    held_out = tmp_path / "heldout.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": w, "answer": a}) + "\n" for w, a in (right | wrong).items()))
    scores = _module("accuracy").accuracy(config.run.dir, held_out, max_new_tokens=3, samples=2)
    assert scores["greedy"] == 0.5
    assert 0 <= scores["sampled"] <= 1
