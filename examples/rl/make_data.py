"""The 2-core RL example's inputs (docs/rl.md): reverse a word of random letters, "cat=tac", a task with a verifiable
answer.

Every word is `--length` (default 3) lowercase letters, so an answer is always that many bytes: the byte tokenizer
has no end-of-text token, a rollout always runs `rl.max_new_tokens` tokens, and with `max_new_tokens = --length`
the completion is the answer alone, which the built-in `exact_match` reward compares with the record's `answer`.

`--words` random words (default 4,000) are drawn, and `--held-out` (default 200) more kept apart in
heldout.jsonl; the rest are the SFT text (sft.txt, one "cat=tac" a line) and the RL prompts (prompts.jsonl:
{"prompt": "cat=", "answer": "tac"}). With `--noise` (default 0), that share of the SFT lines copy the word instead
of reversing it ("cat=cat"), imperfect demonstrations as collected ones are; the prompts' answers stay right.

    python examples/rl/make_data.py data/rl-example
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path


def write_jsonl(path: Path, words: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": f"{w}=", "answer": w[::-1]}) + "\n" for w in words))


def main(out: Path, words: int = 4000, held_out: int = 200, length: int = 3, noise: float = 0.0, seed: int = 0) -> None:
    rnd = random.Random(seed)
    chosen: dict[str, None] = {}  # distinct words, in the order drawn
    while len(chosen) < words + held_out:
        chosen["".join(rnd.choices(string.ascii_lowercase, k=length))] = None
    train, kept = list(chosen)[:words], list(chosen)[words:]
    out.mkdir(parents=True, exist_ok=True)
    (out / "sft.txt").write_text("".join(f"{w}={w if rnd.random() < noise else w[::-1]}\n" for w in train))
    write_jsonl(out / "prompts.jsonl", train)
    write_jsonl(out / "heldout.jsonl", kept)
    print(f"{out}: sft.txt and prompts.jsonl ({len(train):,} words), heldout.jsonl ({len(kept)})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write sft.txt, prompts.jsonl and heldout.jsonl into")
    parser.add_argument("--words", type=int, default=4000, help="words to train on (SFT text and RL prompts)")
    parser.add_argument("--held-out", type=int, default=200, help="words kept apart for the accuracy")
    parser.add_argument("--length", type=int, default=3, help="letters per word")
    parser.add_argument("--noise", type=float, default=0.0, help="share of SFT lines that copy instead of reverse")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.out, args.words, args.held_out, args.length, args.noise, args.seed)
