"""Chat test data: a tiny byte-level BPE with ChatML-like special tokens and a chat template, random
conversations, and a tiny model fine-tuned on them (with its export), built once per session."""

import json
import random

from paralm.data.prepare import prepare_dataset
from paralm.hf.export import export_run
from paralm.job import train
from tests.helpers import tiny_config

WORDS = ("the a model trains on many ranks with data tensor pipeline expert context parallel loss step batch").split()  # noqa: SIM905 - a sentence reads better than a list of words
# The assistant's header ends in "da" and one reply starts with "ta": BPE merges them into "data", a token
# half template, half reply (a seam). Text after each turn's end-of-turn token is not the assistant's.
HEADER = "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}da"
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}" + HEADER + "{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\nda{% endif %}"
)
UNMARKED = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CHATML = TEMPLATE.replace("%}da", "%}").replace("\nda{%", "\n{%")  # without the seam: what chat_run trains on


def say(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def chat_tokenizer(folder, template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rnd = random.Random(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([say(rnd, 30) for _ in range(300)], trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def conversations(count: int) -> list[list[dict]]:
    rnd = random.Random(1)
    chats = []
    for i in range(count):
        turns = [{"role": "system", "content": say(rnd, 4)}] if i % 3 == 0 else []
        for _ in range(rnd.randint(1, 3)):
            turns += [
                {"role": "user", "content": say(rnd, rnd.randint(2, 8))},
                {"role": "assistant", "content": say(rnd, rnd.randint(1, 10))},
            ]
        chats.append(turns)
    chats[0][-1]["content"] = "ta model"  # the seam
    return chats


def chat_dataset(root, count: int = 150):
    """`count` conversations rendered with TEMPLATE and prepared as a dataset with loss masks, in `root`."""
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(count)))
    tokenizer = chat_tokenizer(root / "tok", TEMPLATE)
    prepare_dataset([str(root / "chats.jsonl")], str(root / "ds"), str(tokenizer), 0, 0.1, chat=True)
    return root / "ds"


_RUN = {}
REPLY = ("no", "yes")


def chat_run(root):
    """A 2-layer GPT trained on 200 conversations rendered with CHATML, each reply "yes" or "no" (whether
    the user's turn says " model"): a few steps learn to end a reply with `<|im_end|>`. With its export;
    made once per session."""
    if "run" in _RUN:
        return _RUN["run"]
    tokenizer = chat_tokenizer(root / "tok", CHATML)
    rnd = random.Random(2)
    asks = [say(rnd, rnd.randint(2, 8)) for _ in range(200)]
    chats = [[{"role": "user", "content": a}, {"role": "assistant", "content": REPLY[" model" in a]}] for a in asks]
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    prepare_dataset([str(root / "chats.jsonl")], str(root / "data"), str(tokenizer), 0, 0.1, chat=True)
    model = {"block_size": 64, "vocab_size": 300}
    steps = {"steps": 60, "lr": 1e-2, "warmup_steps": 0, "decay_steps": 60}
    train(tiny_config(root / "run", data={"path": str(root / "data")}, model=model, train=steps))
    export_run(str(root / "run"), str(root / "hf"))
    _RUN["run"] = root / "run", root / "hf", tokenizer
    return _RUN["run"]
