"""A reward of one's own for the RL example (docs/rl.md), named in `rl.rewards` as
`examples.rl.reverse_reward:letters`: partial credit where `exact_match` gives none."""


def letters(prompt: str, completion: str, answer: str) -> float:
    """The share of the answer's letters that the completion has in their places (1.0: the whole answer)."""
    right = sum(a == b for a, b in zip(completion, answer, strict=False))  # a short completion: its letters
    return right / len(answer)
