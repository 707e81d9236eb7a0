"""The 2-core chat example's inputs (docs/sft.md): a byte-level BPE tokenizer folder with a ChatML chat template,
a text corpus to pretrain a tiny base on (Python's documentation, as paralm's embedded corpus), and chats.jsonl:
conversations of 1 to 4 questions about opposites ("What is the opposite of hot?" -> "The opposite of hot is
cold."), asked in four phrasings.

    python examples/chat/make_data.py data/chat-example
"""

import json
import pydoc_data.topics
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAIRS = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"), ("open", "closed"), ("light", "dark"),
    ("early", "late"), ("full", "empty"), ("hard", "soft"), ("high", "low"), ("old", "new"), ("rich", "poor"),
    ("strong", "weak"), ("wet", "dry"), ("loud", "quiet"), ("long", "short"), ("thick", "thin"), ("near", "far"),
    ("first", "last"), ("true", "false"), ("left", "right"), ("push", "pull"), ("win", "lose"), ("buy", "sell"),
]  # fmt: skip
ASKS = ["What is the opposite of {}?", "Opposite of {}?", "Give me the antonym of {}.", "{}: what is its opposite?"]
SYSTEM = "You answer questions about words."
# ChatML; {% generation %} marks what the loss trains on (the assistant's reply and its <|im_end|>).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def conversation(rnd: random.Random) -> list[dict]:
    turns = [{"role": "system", "content": SYSTEM}] if rnd.random() < 0.5 else []
    for _ in range(rnd.randint(1, 4)):
        word, opposite = rnd.choice(PAIRS)[:: rnd.choice((1, -1))]
        turns.append({"role": "user", "content": rnd.choice(ASKS).format(word)})
        turns.append({"role": "assistant", "content": f"The opposite of {word} is {opposite}."})
    return turns


def main(out: Path) -> None:
    rnd = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    corpus = "\n\n".join(text for _, text in sorted(pydoc_data.topics.topics.items()))
    (out / "corpus.txt").write_text(corpus)
    chats = [conversation(rnd) for _ in range(2000)]
    with open(out / "chats.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": c}) + "\n" for c in chats)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = [corpus[i : i + 2000] for i in range(0, len(corpus), 2000)]
    roles = ["user\n", "assistant\n", "system\n"] * 100
    tokenizer.train_from_iterator(texts + roles + [m["content"] for c in chats for m in c], trainer)
    (out / "tokenizer").mkdir(exist_ok=True)
    tokenizer.save(str(out / "tokenizer" / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    print(
        f"{out}: tokenizer/ (BPE, 1024 tokens, ChatML template), corpus.txt, chats.jsonl ({len(chats)} conversations)"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "data/chat-example"))
