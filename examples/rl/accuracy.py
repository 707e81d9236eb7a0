"""Held-out exact-match accuracy of a paralm run on prompts with answers (the RL example's heldout.jsonl):
greedy, and the mean over `--samples` completions drawn at `--temperature` (what a rollout sees).

Every completion is `--max-new-tokens` tokens (the byte tokenizer has no end of text) scored by the reward
`paralm rl` trains on, `paralm.rl.rewards.exact_match`. All prompts of one length go in one batch.

    python examples/rl/accuracy.py --run runs/rl-sft --prompts data/rl-example/heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from paralm.data.shards import read_meta
from paralm.data.tokenizer import load_tokenizer
from paralm.models.sampling import generate
from paralm.rl.rewards import exact_match
from paralm.runs import load_trained_model


def accuracy(
    run: Path, prompts: Path, max_new_tokens: int = 3, samples: int = 8, temperature: float = 1.0, seed: int = 0
) -> dict[str, float]:
    """{"greedy": share right at temperature 0, "sampled": share right over `samples` draws per prompt}."""
    trained = load_trained_model(run)
    tokenizer = load_tokenizer(read_meta(trained.data_dir)["tokenizer"], trained.data_dir)
    records = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    by_length = defaultdict(list)  # prompts of one length batch without padding
    for r in records:
        by_length[len(tokenizer.encode(r["prompt"]))].append(r)
    generator = torch.Generator(trained.device).manual_seed(seed)
    right = {"greedy": 0.0, "sampled": 0.0}
    for group in by_length.values():
        ids = torch.tensor([tokenizer.encode(r["prompt"]) for r in group], device=trained.device)
        for mode, repeat, temp in (("greedy", 1, 0.0), ("sampled", samples, temperature)):
            batch = ids.repeat_interleave(repeat, dim=0)
            out = generate(
                trained.model, batch, max_new_tokens, trained.config.model.block_size, temp, generator=generator
            )
            texts = [tokenizer.decode(row[ids.shape[1] :].tolist()) for row in out]
            for i, text in enumerate(texts):
                r = group[i // repeat]
                right[mode] += exact_match(r["prompt"], text, str(r["answer"])) / repeat
    return {mode: n / len(records) for mode, n in right.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="a paralm run folder (train or rl)")
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL of {prompt, answer}")
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8, help="draws per prompt for the sampled accuracy")
    parser.add_argument("--temperature", type=float, default=1.0, help="of the sampled accuracy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    scores = accuracy(args.run, args.prompts, args.max_new_tokens, args.samples, args.temperature, args.seed)
    print(
        f"{args.run}: held-out exact match, greedy {scores['greedy']:.3f}, "
        f"sampled (T={args.temperature:g}, {args.samples} per prompt) {scores['sampled']:.3f}"
    )


if __name__ == "__main__":
    main()
