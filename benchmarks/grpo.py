"""GRPO on docs/rl.md's 2-core example: the held-out accuracy it adds over SFT and over SFT continued for the same
wall time, where an RL step's time goes, and paralm's GRPO beside TRL's `GRPOTrainer` (issue 53).

    python benchmarks/grpo.py [--sft-steps 500] [--rl-steps 200] [--seeds 1 2 3] [--trl-steps 60] [--threads 1]
        [--n-layer 4] [--d-model 128] [--noise 0.5] [--held-out 200] [--samples 8]

Data: `examples/rl/make_data.py` (reverse three random letters, "cat=tac"; `--held-out` words kept apart),
`paralm data prepare`d as bytes. Model and [rl] section: `examples/rl/reverse.toml` (a 4-layer Llama; `--n-layer`,
`--d-model` override it). Every process runs `--threads` threads.

1. Accuracy. One SFT base (`paralm train`, `--sft-steps`); then, for each seed, from that base: `paralm rl`
   (`--rl-steps` rollouts of the config's [rl] section: GRPO on exact_match + the per-letter reward, 16 prompts x 8
   completions of 3 tokens, at a constant `--rl-lr`), and `paralm train` continued on the SFT text (at a constant
   `--sft-lr`) for as many steps as take the RL run's time at the base's median seconds per step. Each is scored
   on the held-out words with `examples/rl/accuracy.py`: greedy, and the mean over `--samples` completions at
   temperature 1 (what a rollout sees). "s" is the sum of the run's `step_time_s` (for RL the rollouts included,
   start-up excluded), so the two arms can be compared in time. Then all of it again, base included, on data
   whose SFT lines each copy the word instead of reversing it with probability `--noise` (`make_data.py --noise`;
   the RL prompts' answers stay right): demonstrations the reward knows better than, where RL has something to add.
2. Rollout vs update: medians over the RL runs' steps (after 2 warm-up steps) of `rollout_tok_s` and
   `update_tok_s` (completion tokens per second) and the share of rollout + update each took.
3. TRL: the base exported (`paralm export`), trained by `trl.GRPOTrainer` on the same prompts (TRL shuffles them
   with its own sampler), group size, completion length, temperature, rewards (the same two functions, weights 1),
   loss (`grpo`, group-scaled advantages, clip 0.2, beta 0, one update per rollout), batch (16 prompts x 8 in
   micro-batches of 32, one optimizer step per rollout) and AdamW (constant `--rl-lr`, betas 0.9/0.95, eps 1e-8,
   weight decay 0.1, clip 1.0), against `paralm rl` with the first seed for `--trl-steps` steps, run right before
   it (the first seed's run above, cut short: the same rows, timed under the same load as TRL). Reward: the mean
   over the first and the last 10 steps; seconds per step: medians after 2 warm-up steps (TRL's own `step_time`,
   its generation included). Skipped, with a line, where TRL is not installed.
Check `uptime` (printed): compare figures within one table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from common import machine, print_table, thread_env

from paralm.rl.rewards import exact_match

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/rl"
CONFIG = EXAMPLE / "reverse.toml"
WARMUP = 2  # steps left out of the medians
LAST = 10  # steps the first and the final reward are averaged over


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def paralm(args: list[str], threads: int) -> None:
    """`python -m paralm ARGS` with `threads` threads; a failure ends the script with its last line."""
    done = subprocess.run(
        [sys.executable, "-m", "paralm", *args], capture_output=True, text=True, env=thread_env(threads), cwd=ROOT
    )
    if done.returncode:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"paralm {args[0]} failed: {last}")


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def seconds(rows: list[dict]) -> float:
    return sum(r["step_time_s"] for r in rows)


def median_after_warmup(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows[WARMUP:] or rows)


class Runs:
    """The benchmark's `paralm` runs, all from `examples/rl/reverse.toml` with the model and data overridden."""

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work, self.args = work, args
        self.common = [
            "--config", str(CONFIG), f"--model.n_layer={args.n_layer}", f"--model.d_model={args.d_model}",
            f"--data.path={work / 'data'}", f"--rl.prompts={work / 'raw/prompts.jsonl'}", "--log.every=1",
            "--log.progress=false", "--train.eval_every=0", "--train.eval_samples=8",
        ]  # fmt: skip

    def constant_lr(self, lr: float) -> list[str]:
        return [f"--train.lr={lr}", f"--train.min_lr={lr}", "--train.warmup_steps=0"]

    def sft(self, name: str, steps: int, extra: list[str]) -> Path:
        run = self.work / name
        options = [f"--train.steps={steps}", f"--train.decay_steps={steps}", f"--run.dir={run}"]
        paralm(["train", *self.common, *options, *extra], self.args.threads)
        return run

    def rl(self, name: str, seed: int, steps: int) -> Path:
        run = self.work / name
        options = [f"--rl.steps={steps}", f"--train.seed={seed}", f"--run.dir={run}"]
        options += [f"--checkpoint.init_from={self.work / 'sft'}", *self.constant_lr(self.args.rl_lr)]
        paralm(["rl", *self.common, *options], self.args.threads)
        return run


def trl_grpo(hf: Path, prompts: Path, work: Path, args: argparse.Namespace) -> dict[str, float] | None:
    """TRL's GRPOTrainer on the exported base, set as the paralm runs are (the module's docstring, part 3): its
    rewards per step and median seconds per step; None where TRL is not installed."""
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        return None
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback

    from paralm.config.load import load_config

    rl = load_config(CONFIG).rl
    functions = [exact_match, example("reverse_reward").letters]
    assert rl.rewards == ["exact_match", "examples.rl.reverse_reward:letters"] and not rl.reward_weights

    def scorer(function: Callable[[str, str, str], float]) -> Callable[..., list[float]]:
        def score(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
            return [function(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]

        score.__name__ = function.__name__
        return score

    records = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])
    micro = 32
    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=args.trl_steps, seed=args.seeds[0], use_cpu=True, report_to="none",
        logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=rl.prompts_per_step * rl.group_size // micro,
        num_generations=rl.group_size, max_completion_length=rl.max_new_tokens, temperature=rl.temperature,
        top_p=rl.top_p, top_k=0, loss_type=rl.loss, scale_rewards=rl.scale_rewards, beta=0.0,
        epsilon=rl.clip_low, epsilon_high=rl.clip_high, num_iterations=1, learning_rate=args.rl_lr,
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
        weight_decay=0.1, max_grad_norm=1.0, bf16=False, fp16=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[scorer(f) for f in functions], args=config, train_dataset=dataset)
    trainer.remove_callback(PrinterCallback)  # its log lines: the table has the figures
    trainer.train()
    logged = [row for row in trainer.state.log_history if "reward" in row]
    return {"rewards": [row["reward"] for row in logged], "step_s": [row["step_time"] for row in logged]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=500, help="steps of the SFT base")
    parser.add_argument("--sft-lr", type=float, default=5e-4, help="constant lr of SFT continued (the base's last)")
    parser.add_argument("--rl-steps", type=int, default=200, help="rollouts of each paralm rl run")
    parser.add_argument("--rl-lr", type=float, default=1e-3, help="constant lr of the RL runs (paralm's and TRL's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--trl-steps", type=int, default=60, help="steps of the TRL comparison; 0 leaves it out")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--noise", type=float, default=0.5, help="share of wrong SFT lines, second table (0: none)")
    parser.add_argument("--held-out", type=int, default=200, help="words kept apart for the accuracy")
    parser.add_argument("--samples", type=int, default=8, help="completions per held-out word for the sampled accuracy")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    score = example("accuracy").accuracy

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        clean, rl_rows = accuracy_runs(work / "clean", args, 0.0, score)
        noisy = accuracy_runs(work / "noisy", args, args.noise, score)[0] if args.noise else None
        runs, base = Runs(work / "clean", args), work / "clean/sft"
        theirs, ours = None, []
        if args.trl_steps:  # paralm's run again, right before TRL's: the two timed under the same load
            ours = metrics(runs.rl("rl-trl", args.seeds[0], args.trl_steps))
            subprocess.run([sys.executable, "-m", "paralm", "export", "--run", str(base), "--out", str(work / "hf")],
                           check=True, capture_output=True, env=thread_env(args.threads))  # fmt: skip
            theirs = trl_grpo(work / "hf", work / "clean/raw/prompts.jsonl", work, args)

    print(
        f"{args.n_layer}-layer Llama, d_model {args.d_model}, bytes; SFT base {args.sft_steps} steps; GRPO "
        f"{args.rl_steps} rollouts of 16 prompts x 8 completions of 3 tokens at lr {args.rl_lr:g}; SFT continued at "
        f"lr {args.sft_lr:g}; {args.held_out} held-out words; {args.threads} thread(s) each"
    )
    headers = ["run", "seed", "steps", "s", "greedy acc", f"sampled acc (T=1, {args.samples}/word)"]
    print_table(headers, clean)
    if noisy:
        print(f"\nThe same, {args.noise:.0%} of the SFT lines wrong (copied, not reversed); the rewards stay right:")
        print_table(headers, noisy)
    print()
    print_rollout(rl_rows)
    print()
    if args.trl_steps and theirs is None:
        print("TRL comparison skipped: trl is not installed (pip install trl)")
    elif args.trl_steps:
        print_trl(ours, theirs, args.trl_steps)
    for line in machine():
        print(line)


def accuracy_runs(
    work: Path, args: argparse.Namespace, noise: float, score: Callable[..., dict[str, float]]
) -> tuple[list[list[str]], list[list[dict]]]:
    """Part 1 on data whose SFT lines are wrong with probability `noise`: the table's rows, and each RL run's
    metrics."""
    example("make_data").main(work / "raw", held_out=args.held_out, noise=noise)
    held_out = work / "raw/heldout.jsonl"
    paralm(["data", "prepare", "--input", str(work / "raw/sft.txt"), "--tokenizer", "byte", "--out",
            str(work / "data")], args.threads)  # fmt: skip
    runs = Runs(work, args)
    base = runs.sft("sft", args.sft_steps, [])
    sft_step = median_after_warmup(metrics(base), "step_time_s")

    def row(name: str, seed: str, run: Path, steps: int) -> list[str]:
        acc = score(run, held_out, samples=args.samples)
        return [name, seed, f"{steps}", f"{seconds(metrics(run)):.1f}", f"{acc['greedy']:.3f}", f"{acc['sampled']:.3f}"]

    table, rl_rows = [row("SFT (base)", "", base, args.sft_steps)], []
    for seed in args.seeds:
        rl = runs.rl(f"rl{seed}", seed, args.rl_steps)
        rl_rows.append(metrics(rl))
        steps = max(1, round(seconds(rl_rows[-1]) / sft_step))
        more = runs.sft(f"more{seed}", steps, [*runs.constant_lr(args.sft_lr), f"--train.seed={seed}",
                                              f"--checkpoint.init_from={base}"])  # fmt: skip
        table += [row("+ GRPO", f"{seed}", rl, args.rl_steps), row("+ SFT, same time", f"{seed}", more, steps)]
    return table, rl_rows


def print_rollout(runs: list[list[dict]]) -> None:
    rows = [r for run in runs for r in run[WARMUP:] or run]
    shares = [r["rollout_s"] / (r["rollout_s"] + r["update_s"]) for r in rows]
    print_table(
        ["part of an RL step", "completion tok/s (median)", "share of rollout + update"],
        [
            ["rollout (3 decoding steps)", f"{statistics.median(r['rollout_tok_s'] for r in rows):,.0f}",
             f"{statistics.median(shares):.0%}"],
            ["update (forward + backward)", f"{statistics.median(r['update_tok_s'] for r in rows):,.0f}",
             f"{1 - statistics.median(shares):.0%}"],
        ],
    )  # fmt: skip


def print_trl(ours: list[dict], theirs: dict[str, list[float]], steps: int) -> None:
    def line(name: str, rewards: list[float], step_s: list[float]) -> list[str]:
        first, last = rewards[:LAST], rewards[-LAST:]
        median = statistics.median(step_s[WARMUP:] or step_s)
        return [name, f"{sum(first) / len(first):.3f}", f"{sum(last) / len(last):.3f}", f"{median:.2f}"]

    print_table(
        ["GRPO", f"reward, first {LAST} steps", f"last {LAST} of {steps}", "s/step"],
        [
            line("paralm rl", [r["reward_mean"] for r in ours], [r["step_time_s"] for r in ours]),
            line("TRL GRPOTrainer", theirs["rewards"], theirs["step_s"]),
        ],
    )


if __name__ == "__main__":
    main()
