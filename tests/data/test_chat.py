"""Chat data: conversations rendered with the tokenizer's chat template, loss masks on the assistant's
tokens stored beside the shards, and malformed chats as one-line errors with nothing written."""

import json
import random

import numpy as np
import pytest

from paralm.data.chat import Chat, ChatRenderer
from paralm.data.prepare import prepare_dataset
from paralm.data.shards import IGNORE, TokenDataset, read_meta
from paralm.errors import UserError

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


def _say(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def _tokenizer(folder, template):
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
    tok.train_from_iterator([_say(rnd, 30) for _ in range(300)], trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}
    if template:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _conversations(count: int) -> list[list[dict]]:
    rnd = random.Random(1)
    chats = []
    for i in range(count):
        turns = [{"role": "system", "content": _say(rnd, 4)}] if i % 3 == 0 else []
        for _ in range(rnd.randint(1, 3)):
            turns += [
                {"role": "user", "content": _say(rnd, rnd.randint(2, 8))},
                {"role": "assistant", "content": _say(rnd, rnd.randint(1, 10))},
            ]
        chats.append(turns)
    chats[0][-1]["content"] = "ta model"  # the seam
    return chats


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in _conversations(60)))
    return root, _tokenizer(root / "marked", TEMPLATE), _tokenizer(root / "unmarked", UNMARKED)


def test_prefix_rendering_gives_the_mask_transformers_gives_with_markers(folders):
    _, marked, unmarked = folders
    with_markers, without = ChatRenderer(marked), ChatRenderer(unmarked)
    assert with_markers.has_markers and not without.has_markers
    seam = 0
    for number, messages in enumerate(_conversations(60)):
        chat = Chat(f"chat {number}", messages)
        ids, mask = with_markers.encode(chat)
        ours_ids, ours = without.encode(chat)
        assert np.array_equal(ids, ours_ids) and np.array_equal(mask, ours), number
        assert mask.any() and not mask.all()
        tokens = [with_markers.tokenizer.decode([i]) for i in ids]
        seam += sum(
            t == "data" and m and tokens[k - 1] == "\n" for k, (t, m) in enumerate(zip(tokens, mask, strict=True))
        )
    assert seam >= 1  # the reply "ta model" after the header's "da": one token, trained on


def test_prepare_stores_the_mask_and_the_document_starts(folders, tmp_path):
    root, marked, _ = folders
    summary = prepare_dataset([str(root / "chats.jsonl")], str(tmp_path / "ds"), str(marked), 0, 0.1, chat=True)
    assert "the loss trains on" in summary
    meta = read_meta(tmp_path / "ds")
    assert meta["loss_mask"] and meta["document_starts"] and meta["documents"] == 60
    renderer = ChatRenderer(marked)
    expected = [renderer.encode(Chat("", c)) for c in _conversations(60)]
    cuts = [len(ids) - round(len(ids) * 0.1) for ids, _ in expected]
    data = TokenDataset(tmp_path / "ds", "train", 16)
    assert np.array_equal(
        np.asarray(data.shards[0]), np.concatenate([i[:c] for (i, _), c in zip(expected, cuts, strict=True)])
    )
    assert np.array_equal(
        np.asarray(data.masks[0]), np.concatenate([m[:c] for (_, m), c in zip(expected, cuts, strict=True)])
    )
    assert np.array_equal(data.starts[0], np.cumsum([0, *cuts[:-1]]))
    windows = np.arange(0, data.num_windows, 7)
    x, y = data.batch(windows)
    trained = np.stack([data.masks[0][w + 1 : w + 17] for w in windows]).astype(bool)
    assert np.array_equal((y != IGNORE).numpy(), trained) and data.trained_tokens(windows) == trained.sum()
    docs = data.documents(windows)
    starts = set(data.starts[0].tolist())
    for row, w in zip(docs.tolist(), windows, strict=True):
        assert row[0] == 0 and all(row[t] - row[t - 1] == (w + t in starts) for t in range(1, 16))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    "rows, tokenizer, match",
    [
        ([{"text": "hi"}], "marked", r"chats\.jsonl:1 has no field 'messages'.*--messages-field"),
        ([{"messages": [{"content": "hi"}]}], "marked", r"chats\.jsonl:1: message 0 has no 'role'"),
        ([{"messages": [{"role": "user"}]}], "marked", r"message 0 has no 'content'"),
        (
            [{"messages": [{"role": "robot", "content": "hi"}]}],
            "marked",
            r"chats\.jsonl:1: the chat template .* rejects",
        ),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "plain", r"has no chat template"),
    ],
)
def test_malformed_chats_are_one_line_errors_and_nothing_is_written(folders, tmp_path, rows, tokenizer, match):
    root, marked, _ = folders
    folder = marked if tokenizer == "marked" else _tokenizer(tmp_path / "plain", None)
    with pytest.raises(UserError, match=match) as error:
        prepare_dataset([_write(tmp_path / "chats.jsonl", rows)], str(tmp_path / "ds"), str(folder), 0, 0.1, chat=True)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob(".ds*"))


@pytest.mark.parametrize("long", ["truncate", "drop"])
def test_conversations_over_max_tokens_are_cut_or_dropped_counted_and_said_once(folders, tmp_path, capsys, long):
    root, marked, _ = folders
    encoded = [ChatRenderer(marked).encode(Chat("", c)) for c in _conversations(60)]
    limit = int(np.median([len(ids) for ids, _ in encoded]))
    over = [(ids, mask) for ids, mask in encoded if len(ids) > limit]
    kept = [len(ids) for ids, _ in encoded if len(ids) <= limit]
    if long == "truncate":
        kept += [limit for _, mask in over if mask[:limit].any()]
    prepare_dataset(
        [str(root / "chats.jsonl")], str(tmp_path / "ds"), str(marked), 0, 0.1, chat=True, max_tokens=limit, long=long
    )
    meta = read_meta(tmp_path / "ds")
    assert meta["documents"] == len(kept) and len(over) > 0
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == sum(kept)
    record = {"max_tokens": limit, "long": long, "count": len(over), "dropped": 60 - len(kept)}
    assert meta["long_conversations"] == record
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{len(over)} of 60 conversations are longer than --max-tokens {limit}" in lines[0]
    assert f"{60 - len(kept)} dropped (--long {long})" in lines[0]


@pytest.mark.parametrize(
    "options, match",
    [
        ({"chat": False, "max_tokens": 64}, r"--max-tokens limits --chat conversations.*add --chat"),
        ({"long": "drop"}, r"--long says .*: add --max-tokens N"),
        ({"max_tokens": 1}, r"--max-tokens 1 .*at least 2"),
        ({"max_tokens": 3, "long": "drop"}, r"every conversation is longer than --max-tokens 3: raise it"),
    ],
)
def test_length_limit_mistakes_are_one_line_errors(folders, tmp_path, options, match):
    root, marked, _ = folders
    with pytest.raises(UserError, match=match):
        prepare_dataset(
            [str(root / "chats.jsonl")], str(tmp_path / "ds"), str(marked), 0, 0.1, **{"chat": True, **options}
        )
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob(".ds*"))


def test_the_chat_template_stays_with_the_prepared_data(folders, tmp_path):
    root, marked, _ = folders
    prepare_dataset([str(root / "chats.jsonl")], str(tmp_path / "ds"), str(marked), 0, 0.1, chat=True)
    assert json.loads((tmp_path / "ds" / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
