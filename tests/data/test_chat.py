"""Chat data: conversations rendered with the tokenizer's chat template, loss masks on the assistant's
tokens stored beside the shards, and malformed chats as one-line errors with nothing written."""

import json
import random

import numpy as np
import pytest

from paralm.data.chat import Chat, ChatRenderer
from paralm.data.prepare import prepare_dataset
from paralm.data.shards import IGNORE, TokenDataset, read_meta
from paralm.data.sources import TextFields
from paralm.data.tokenize_pool import Encoding, encode_stream
from paralm.errors import UserError
from tests.chat_helpers import TEMPLATE, UNMARKED, chat_tokenizer, conversations, say


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(60)))
    return root, chat_tokenizer(root / "marked", TEMPLATE), chat_tokenizer(root / "unmarked", UNMARKED)


def test_prefix_rendering_gives_the_mask_transformers_gives_with_markers(folders):
    _, marked, unmarked = folders
    with_markers, without = ChatRenderer(marked), ChatRenderer(unmarked)
    assert with_markers.has_markers and not without.has_markers
    seam = 0
    for number, messages in enumerate(conversations(60)):
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
    expected = [renderer.encode(Chat("", c)) for c in conversations(60)]
    held_out = [n for n in range(60) if n % 10 == 9]  # whole conversations, every tenth
    train = [pair for n, pair in enumerate(expected) if n not in held_out]
    data, val = TokenDataset(tmp_path / "ds", "train", 16), TokenDataset(tmp_path / "ds", "val", 16)
    assert np.array_equal(np.asarray(data.shards[0]), np.concatenate([i for i, _ in train]))
    assert np.array_equal(np.asarray(data.masks[0]), np.concatenate([m for _, m in train]))
    assert np.array_equal(np.asarray(val.shards[0]), np.concatenate([expected[n][0] for n in held_out]))
    assert np.array_equal(data.starts[0], np.cumsum([0, *[len(i) for i, _ in train[:-1]]]))
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


USER = {"role": "user", "content": "the model"}


@pytest.mark.parametrize(
    "rows, tokenizer, match",
    [
        ([{"text": "hi"}], "marked", r"chats\.jsonl:1 has no field 'messages'.*--messages-field"),
        ([{"messages": []}], "marked", r"chats\.jsonl:1: 'messages' is an empty list: .*leave the row out"),
        ([{"messages": [USER, {"role": "assistant", "content": None}]}], "marked", r":1: message 1's content is null"),
        ([{"messages": [{"role": "user", "content": 3}]}], "marked", r"message 0's content \(int\) is neither text"),
        (
            [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}],
            "marked",
            r"chats\.jsonl:1: message 0 has a content part of type 'image_url': paralm trains on text only",
        ),
        ([{"messages": [{"role": "user", "content": [{"type": "text"}]}]}], "marked", r'text part without a "text"'),
        ([{"messages": [{"role": "user", "content": ["hi"]}]}], "marked", r"content parts are not objects like"),
        ([{"messages": [{"content": "hi"}]}], "marked", r"chats\.jsonl:1: message 0 has no 'role'"),
        ([{"messages": [{"role": "user"}]}], "marked", r"message 0 has no 'content'"),
        (
            [{"messages": [{"role": "robot", "content": "hi"}]}],
            "marked",
            r"chats\.jsonl:1: the chat template .* rejects",
        ),
        ([{"messages": [{"role": "user", "content": "hi"}]}], None, r"has no chat template"),
        (
            [{"messages": [USER]}],
            "{% for m in messages %}{{ m['content'] }}{{ 1 / 0 }}{% endfor %}",
            r"chats\.jsonl:1: the chat template of .*other fails on this conversation \(ZeroDivisionError: division",
        ),
    ],
)
def test_malformed_chats_are_one_line_errors_and_nothing_is_written(folders, tmp_path, rows, tokenizer, match):
    """`tokenizer`: the shared folder ("marked"), or one with this chat template (None: without one)."""
    root, marked, _ = folders
    folder = marked if tokenizer == "marked" else chat_tokenizer(tmp_path / "other", tokenizer)
    with pytest.raises(UserError, match=match) as error:
        prepare_dataset([_write(tmp_path / "chats.jsonl", rows)], str(tmp_path / "ds"), str(folder), 0, 0.1, chat=True)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob(".ds*"))


@pytest.mark.parametrize("long", ["truncate", "drop"])
def test_conversations_over_max_tokens_are_cut_or_dropped_counted_and_said_once(folders, tmp_path, capsys, long):
    root, marked, _ = folders
    encoded = [ChatRenderer(marked).encode(Chat("", c)) for c in conversations(60)]
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


def test_held_out_conversations_do_not_depend_on_the_batching(folders):
    _, marked, _ = folders
    chats = [Chat(str(n), c) for n, c in enumerate(conversations(30))]
    encoding = Encoding(None, None, None, 0.25, "uint16", str(marked))

    def val(batch_bytes):
        return np.concatenate([e.val.tokens for e in encode_stream(encoding, iter(chats), 1, batch_bytes)])

    assert np.array_equal(val(40), val(1 << 20)) and len(val(40)) > 0


@pytest.mark.parametrize("kind", ["parquet", "saved dataset"])
def test_parquet_and_saved_datasets_prepare_as_the_jsonl_does(folders, tmp_path, kind):
    """The same conversations as a Parquet file or a `save_to_disk` folder (with `--messages-field`'s column):
    the same tokens, masks and document starts as from JSONL."""
    import datasets

    root, marked, _ = folders
    table = datasets.Dataset.from_list([{"turns": c} for c in conversations(60)])
    source = tmp_path / ("chats.parquet" if kind == "parquet" else "chats-saved")
    if kind == "parquet":
        table.to_parquet(str(source))
    else:
        table.save_to_disk(str(source))
    prepare_dataset([str(root / "chats.jsonl")], str(tmp_path / "from-jsonl"), str(marked), 0, 0.1, chat=True)
    prepare_dataset(
        [str(source)], str(tmp_path / "other"), str(marked), 0, 0.1, chat=True, fields=TextFields(messages="turns")
    )
    a, b = TokenDataset(tmp_path / "from-jsonl", "train", 16), TokenDataset(tmp_path / "other", "train", 16)
    assert np.array_equal(np.asarray(a.shards[0]), np.asarray(b.shards[0]))
    assert np.array_equal(np.asarray(a.masks[0]), np.asarray(b.masks[0]))
    assert np.array_equal(a.starts[0], b.starts[0])


ANY_ROLE = TEMPLATE.replace("{{ raise_exception('unknown role ' + m['role']) }}", "")  # renders every role


@pytest.mark.parametrize(
    "roles, match",
    [
        (("human", "gpt"), r"roles human/gpt: paralm trains the turns of role 'assistant' .*map human to user, gpt to"),
        (("user", "Assistant"), r"role Assistant: .*map Assistant to assistant"),
        (("system", "user"), r"no message has role 'assistant' \(roles: system, user\)"),
    ],
)
def test_chats_that_train_no_token_are_refused_and_the_last_dataset_kept(tmp_path, roles, match):
    """Roles the template renders but does not train (ShareGPT's, a capital): refused naming the file and the
    likely cause, nothing written, and the dataset prepared before at --out left as it was."""
    folder = chat_tokenizer(tmp_path / "tok", ANY_ROLE)
    good = [{"messages": c} for c in conversations(20)]
    prepare_dataset([_write(tmp_path / "good.jsonl", good)], str(tmp_path / "ds"), str(folder), 0, 0.1, chat=True)
    before = read_meta(tmp_path / "ds")
    rows = [{"messages": [{"role": r, "content": say(random.Random(n), 5)} for r in roles]} for n in range(20)]
    with pytest.raises(UserError, match=match) as error:
        prepare_dataset([_write(tmp_path / "chats.jsonl", rows)], str(tmp_path / "ds"), str(folder), 0, 0.1, chat=True)
    assert str(error.value).startswith(f"{tmp_path / 'chats.jsonl'}: no token to train on: ")
    assert "\n" not in str(error.value)
    assert read_meta(tmp_path / "ds") == before and not list(tmp_path.glob(".ds*"))


@pytest.mark.parametrize("counted", ["per split", "both splits"])
def test_training_refuses_a_prepared_dataset_with_no_trained_token(folders, tmp_path, counted):
    """A dataset that trains no token (prepared before `prepare` refused one; meta.json then counted both
    splits together): its train split is refused in one line, its validation split still reads."""
    root, marked, _ = folders
    prepare_dataset([str(root / "chats.jsonl")], str(tmp_path / "ds"), str(marked), 0, 0.1, chat=True)
    meta = read_meta(tmp_path / "ds")
    assert meta["splits"]["train"]["trained_tokens"] + meta["splits"]["val"]["trained_tokens"] == meta["trained_tokens"]
    if counted == "per split":
        meta["splits"]["train"]["trained_tokens"] = 0
    else:
        meta["trained_tokens"] = 0
        for split in meta["splits"].values():
            del split["trained_tokens"]
    (tmp_path / "ds" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"ds: no token of its train split is an assistant's") as error:
        TokenDataset(tmp_path / "ds", "train", 16)
    assert "\n" not in str(error.value)
    TokenDataset(tmp_path / "ds", "val", 16)


def test_content_parts_train_as_their_joined_text(folders, tmp_path):
    """A content given as text parts (`[{"type": "text", "text": ...}, ...]`) is their text joined, as chat
    templates join them: the same tokens and mask as the plain string, not the list's Python repr."""
    _, marked, _ = folders
    chats = conversations(20)
    parts = [
        [{**m, "content": [{"type": "text", "text": w + " "} for w in m["content"].split(" ")]} for m in c]
        for c in chats
    ]
    for c in parts:
        for m in c:
            m["content"][-1]["text"] = m["content"][-1]["text"][:-1]
    for name, rows in (("plain", chats), ("parts", parts)):
        path = _write(tmp_path / f"{name}.jsonl", [{"messages": c} for c in rows])
        prepare_dataset([path], str(tmp_path / name), str(marked), 0, 0.1, chat=True)
    a, b = TokenDataset(tmp_path / "plain", "train", 16), TokenDataset(tmp_path / "parts", "train", 16)
    assert np.array_equal(np.asarray(a.shards[0]), np.asarray(b.shards[0]))
    assert np.array_equal(np.asarray(a.masks[0]), np.asarray(b.masks[0]))
