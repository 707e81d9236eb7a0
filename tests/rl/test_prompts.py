"""`rl.prompts`: JSONL, Parquet, folders and saved datasets read alike; `prompt` strings tokenized as they are,
`messages` rendered with the run's chat template and its generation prompt; every record that cannot be
prompted refused in one line naming `rl.prompts`, the record and the fix."""

import json

import pytest

from paralm.config.rl import RLConfig
from paralm.data.prepare import prepare_dataset
from paralm.errors import UserError
from paralm.rl.prompts import Prompt, load_prompts
from tests.chat_helpers import CHATML, chat_tokenizer

RECORDS = [
    {"prompt": "2 + 2 =", "answer": "4"},
    {"prompt": "3 * 3 =", "answer": 9},
    {"prompt": "no answer here"},
]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the model trains"}]
NO_GENERATION_PROMPT = CHATML[: CHATML.index("{% if add_generation_prompt %}")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Prepared data of the byte tokenizer, of a tokenizer with a chat template, and of one whose template
    opens no assistant turn."""
    root = tmp_path_factory.mktemp("prompts_data")
    (root / "corpus.txt").write_text("the model trains on many ranks. " * 20)
    prepare_dataset([str(root / "corpus.txt")], str(root / "byte"), "byte", 0, 0.1)
    for name, template in (("chat", CHATML), ("no_gen", NO_GENERATION_PROMPT)):
        tokenizer = chat_tokenizer(root / f"tok_{name}", template)
        prepare_dataset([str(root / "corpus.txt")], str(root / name), str(tokenizer), 0, 0.1)
    return root


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def load(path, data_dir, max_new_tokens=8, block_size=64):
    return load_prompts(RLConfig(prompts=str(path), max_new_tokens=max_new_tokens), data_dir, block_size)


def test_prompt_strings_are_the_byte_tokens_of_their_text(data, tmp_path):
    prompts = load(jsonl(tmp_path / "p.jsonl", RECORDS), data / "byte")
    assert prompts == [
        Prompt(0, list(b"2 + 2 ="), "2 + 2 =", "4"),
        Prompt(1, list(b"3 * 3 ="), "3 * 3 =", "9"),  # a numeric answer as a string
        Prompt(2, list(b"no answer here"), "no answer here", None),
    ]


def test_parquet_folders_and_saved_datasets_read_as_jsonl(data, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected = load(jsonl(tmp_path / "p.jsonl", RECORDS), data / "byte")
    rows = [{**r, "answer": None if "answer" not in r else str(r["answer"])} for r in RECORDS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    shards = tmp_path / "shards"
    shards.mkdir()
    jsonl(shards / "a.jsonl", RECORDS[:2])
    jsonl(shards / "b.jsonl", RECORDS[2:])
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    split = datasets.Dataset.from_list(rows[:1])
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": split}).save_to_disk(str(tmp_path / "dd"))
    for path in ("p.parquet", "shards", "saved", "dd"):
        assert load(tmp_path / path, data / "byte") == expected, path


def test_messages_are_rendered_with_the_chat_template_and_its_generation_prompt(data, tmp_path):
    from transformers import AutoTokenizer

    prompts = load(jsonl(tmp_path / "p.jsonl", [{"messages": CHAT, "answer": "yes"}, RECORDS[0]]), data / "chat")
    hf = AutoTokenizer.from_pretrained(str(data / "tok_chat"))
    text = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    end_of_turn = hf.convert_tokens_to_ids("<|im_end|>")
    assert prompts[0] == Prompt(0, hf(text, add_special_tokens=False)["input_ids"], text, "yes", (end_of_turn,))
    assert prompts[1].stop == ()  # a string prompt ends at the end of text only
    assert prompts[1].ids == hf(RECORDS[0]["prompt"], add_special_tokens=False)["input_ids"]  # a string: no template


def test_a_prompt_fits_the_block_with_its_completion_exactly(data, tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "abcdef"}, {"prompt": "abcdefg"}])
    with pytest.raises(UserError) as e:
        load(path, data / "byte", max_new_tokens=10, block_size=16)
    message = str(e.value)
    assert "rl.prompts record 1" in message and "7 prompt tokens" in message and "model.block_size = 16" in message
    assert len(load(path, data / "byte", max_new_tokens=9, block_size=16)) == 2


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "does not exist"),
        ("", "holds no records"),
        ('{"prompt": "a"}\nnot json\n', "p.jsonl:2 is not a JSON object"),
        ('{"question": "a"}\n', "record 0 has neither a `prompt` string nor a `messages` list"),
        ('{"prompt": "a"}\n{"prompt": "b", "messages": []}\n', "record 1 has both"),
        ('{"prompt": 5}\n', "`prompt` is int"),
        ('{"prompt": "a"}\n{"prompt": ""}\n', "record 1: the prompt has no tokens"),
        ('{"messages": "hi"}\n', "`messages` is str"),
        ('{"messages": [{"role": "user"}]}\n', "message 0 has no 'content'"),
        ('{"prompt": "a", "answer": [1]}\n', "`answer` is list"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', "has no chat template"),
    ],
)
def test_records_that_cannot_be_prompted_are_one_line_errors(data, tmp_path, content, fragment):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as e:
        load(path, data / "byte")
    message = str(e.value)
    assert "\n" not in message and "rl.prompts" in message and fragment in message


def test_a_template_that_opens_no_reply_is_refused(data, tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [RECORDS[0], {"messages": CHAT}])
    with pytest.raises(UserError, match=r"^rl\.prompts record 1: the run's chat template adds no generation prompt"):
        load(path, data / "no_gen")


def test_unreadable_files_and_folders_name_rl_prompts(data, tmp_path):
    import datasets

    (tmp_path / "p.csv").write_text("prompt\na\n")
    (tmp_path / "bad.parquet").write_text("not parquet")
    (tmp_path / "empty").mkdir()
    datasets.DatasetDict({"test": datasets.Dataset.from_list(RECORDS[:1])}).save_to_disk(str(tmp_path / "dd"))
    for path, fragment in (
        ("p.csv", "neither JSONL"),
        ("bad.parquet", "not a readable Parquet file"),
        ("empty", "no JSONL or Parquet file"),
        ("dd", "no `train`"),
    ):
        with pytest.raises(UserError, match=fragment) as e:
            load(tmp_path / path, data / "byte")
        assert str(e.value).startswith("rl.prompts = ") and "\n" not in str(e.value), path
