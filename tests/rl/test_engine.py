"""`paralm rl`'s loop: rollouts, rewards and the policy's update on one process and on the layouts it runs on."""

import json
import os
import subprocess
import sys

import pytest
import torch

from paralm.job import train
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.rl.engine import RolloutEngine
from paralm.runs import load_trained_model
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

REWARD = '''
def vowels(prompt, completion, answer):
    """The share of vowels in the completion: a reward any byte-level policy can move."""
    return sum(c in "aeiou" for c in completion) / max(1, len(completion))
'''
ROW = ("loss", "reward_mean", "reward_std", "grad_norm", "entropy", "completion_len", "clip_fraction", "kl")


@pytest.fixture
def prompts(tmp_path, monkeypatch):
    (tmp_path / "vowel_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "prompts.jsonl"
    starts = ["def ", "The ", "class ", "import ", "return ", "This ", "for ", "if "]
    path.write_text("".join(json.dumps({"prompt": s, "answer": s.strip()}) + "\n" for s in starts))
    return path


def rl_config(run_dir, prompts, rl=None, **sections):
    rl = {
        "prompts": str(prompts),
        "rewards": ["vowel_reward:vowels", "exact_match"],
        "group_size": 4,
        "prompts_per_step": 4,
        "max_new_tokens": 6,
        "steps": 2,
        **(rl or {}),
    }
    train_section = {"lr": 3e-2, "warmup_steps": 0, "micro_batch_size": 8, **sections.pop("train", {})}
    config = tiny_config(run_dir, rl=rl, train=train_section, **sections)
    config.train.steps = config.rl.steps * config.rl.updates_per_rollout  # as the verb does
    return config


def rl_looking(config):
    """Run `config` in a process group of its own; returns this rank's last rollout batch's completion rows and
    its parameters' local shapes."""
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime, engine_type=RolloutEngine)
    trainer.fit()
    engine = trainer.engine
    rows = sum(x.shape[0] for x, _ in engine.current.micro_batches)
    shapes = {
        name: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
        for name, p in engine.model.named_parameters()
    }
    shutdown(runtime)
    return rows, shapes


def test_one_process_samples_scores_and_updates(tmp_path, prompts):
    config = rl_config(tmp_path / "run", prompts)
    train(config, RolloutEngine)
    rows = read_metrics(config.run.dir)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert set(ROW) | {"reward/vowel_reward:vowels", "reward/exact_match", "accuracy"} <= set(row)
        assert row["completion_len"] <= 6 and row["truncated"] == 1.0  # a byte tokenizer has no stop token
        assert row["rollout_tok_s"] > 0 and row["update_tok_s"] > 0
    assert rows[0]["grad_norm"] > 0  # the rewards differ within groups: the policy moves
    assert load_trained_model(config.run.dir).checkpoint.name == "step_000002"  # a run folder as training leaves


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"zero": 0}, {"zero": 3}, {"tp": 2}], ids=["ddp", "zero3", "tp2"])
def test_two_ranks_roll_out_and_update_as_one_process(tmp_path, prompts, parallel):
    """Same seed, same rollouts and losses: each data-parallel rank samples its own prompts' groups (half the
    completions under DDP and ZeRO-3; the same under TP, whose ranks hold half of each weight)."""
    single = rl_config(tmp_path / "single", prompts)
    ranks = rl_config(tmp_path / "ranks", prompts, parallel=parallel)
    one_rows, one_shapes = run_ranks(rl_looking, 1, tmp_path, single)[0]
    (rows, shapes), _ = run_ranks(rl_looking, 2, tmp_path, ranks)
    a, b = read_metrics(single.run.dir), read_metrics(ranks.run.dir)
    assert len(a) == len(b) == 2
    for x, y in zip(a, b, strict=True):
        for name in ROW:
            assert abs(x[name] - y[name]) <= 1e-5 * max(1.0, abs(x[name])), (name, x[name], y[name])
    if "tp" in parallel:
        assert rows == one_rows  # every TP rank samples the data-parallel rank's whole share
        assert sum(shapes[n] != one_shapes[n] for n in shapes) >= 4 * single.model.n_layer  # weights split
    else:
        assert rows * 2 == one_rows  # each data-parallel rank rolled out its own half
        if parallel["zero"] == 3:
            assert all(shapes[n][0] * 2 == one_shapes[n][0] for n in shapes if one_shapes[n][0] % 2 == 0)


def test_several_updates_per_rollout_keep_the_sampling_policy(tmp_path, prompts):
    """mu = 2: the second update's ratio is to the policy that sampled (clipped once it moved past the range)."""
    config = rl_config(tmp_path / "run", prompts, rl={"updates_per_rollout": 2, "clip_low": 0.01, "clip_high": 0.01})
    train(config, RolloutEngine)
    rows = read_metrics(config.run.dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["reward_mean"] == rows[1]["reward_mean"]  # one rollout, two updates
    assert rows[0]["clip_fraction"] == 0  # the first update is the sampling policy itself
    assert rows[1]["clip_fraction"] > 0  # lr 3e-2 moved it beyond 1 +- 0.01


def test_kl_to_the_reference_grows_from_zero_and_resume_continues_exactly(tmp_path, prompts):
    base = tiny_config(tmp_path / "base", train={"steps": 1})
    train(base)
    kl = {"kl_beta": 0.1, "steps": 3}
    whole = rl_config(tmp_path / "whole", prompts, rl=kl, checkpoint={"init_from": str(base.run.dir)})
    train(whole, RolloutEngine)
    rows = read_metrics(whole.run.dir)
    assert rows[0]["kl"] == 0 and rows[1]["kl"] > 0 and "reference_s" in rows[0]
    first = rl_config(tmp_path / "resumed", prompts, rl={**kl, "steps": 2}, checkpoint={"init_from": str(base.run.dir)})
    train(first, RolloutEngine)
    again = rl_config(tmp_path / "resumed", prompts, rl=kl, checkpoint={"init_from": str(base.run.dir)})
    train(again, RolloutEngine)
    resumed = read_metrics(again.run.dir)
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for x, y in zip(rows, resumed, strict=True):
        assert x["loss"] == y["loss"] and x["reward_mean"] == y["reward_mean"] and x["kl"] == y["kl"]
    final = [load_trained_model(d).model.state_dict() for d in (whole.run.dir, again.run.dir)]
    for name, value in final[0].items():
        torch.testing.assert_close(value, final[1][name], rtol=0, atol=0)


def test_lora_policy_samples_through_its_adapters_and_trains_only_them(tmp_path, prompts):
    base = tiny_config(tmp_path / "base", train={"steps": 1})
    train(base)
    lora = {"lora_rank": 4, "lora_alpha": 8.0}
    config = rl_config(
        tmp_path / "lora", prompts, rl={"steps": 3}, train=lora, checkpoint={"init_from": str(base.run.dir)}
    )
    train(config, RolloutEngine)
    before = load_trained_model(base.run.dir).model.state_dict()
    adapted = load_trained_model(config.run.dir, merge=False).model.state_dict()
    frozen = [n for n in adapted if "lora" not in n]
    assert all(torch.equal(adapted[n], before[n]) for n in frozen)  # the base weights are the base run's
    assert any(adapted[n].abs().sum() > 0 for n in adapted if "lora_b" in n)  # the adapters learned
    rows = read_metrics(config.run.dir)
    assert rows[0]["grad_norm"] > 0 and rows[2]["entropy"] != rows[0]["entropy"]


@pytest.mark.slow
def test_a_reward_that_fails_on_one_rank_stops_every_rank_with_one_line(tmp_path, prompts):
    """The failing rank names the function and the prompt; the others do not wait for its rewards forever."""
    (tmp_path / "failing_reward.py").write_text(
        "def picky(prompt, completion, answer):\n    if prompt == 'class ':\n        raise ValueError('no classes')\n"
        "    return 1.0\n"
    )
    args = [
        sys.executable,
        "-m",
        "paralm",
        "rl",
        "--nproc",
        "2",
        f"--run.dir={tmp_path / 'run'}",
        f"--rl.prompts={prompts}",
        "--rl.rewards=failing_reward:picky",
        "--rl.group_size=2",
        "--rl.prompts_per_step=8",
        "--rl.max_new_tokens=2",
        "--rl.steps=1",
        "--model.n_layer=1",
        "--model.d_model=32",
        "--model.n_head=2",
        "--model.block_size=32",
        "--log.tensorboard=false",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "failing_reward:picky" in errors[0] and "prompt 2" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
