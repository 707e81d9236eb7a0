"""The prompts `paralm rl` samples completions for, read once from `rl.prompts` (a JSONL or Parquet file, a
folder of them, or a `datasets.save_to_disk` folder) and checked up front: every record has a `prompt`
string (tokenized as it is) or a `messages` list (rendered with the run's chat template and its generation
prompt), and fits `model.block_size` with `rl.max_new_tokens` after it. `answer`, where given, is what
the rewards compare against. Records are counted from 0 in `Prompt.index` and in the errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from paralm.config.rl import RLConfig
from paralm.data.chat import check_messages
from paralm.data.shards import read_meta
from paralm.data.sources import JSONL_SUFFIXES, PARQUET_SUFFIXES, SAVED_DATASET_FILES
from paralm.data.tokenizer import Tokenizer, load_tokenizer
from paralm.errors import UserError
from paralm.generate import ChatTemplate

FIELD = "rl.prompts"


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the prompts file, from 0 (errors name it)
    ids: list[int]  # the tokens a completion continues
    text: str  # the prompt as reward functions see it: the `prompt` string, or the rendered chat text
    answer: str | None  # the record's `answer` as a string; None where it has none
    stop: tuple[int, ...] = ()  # tokens that end its completion besides the end of text: a chat template's end of turn


def load_prompts(rl: RLConfig, data_dir: Path, block_size: int) -> list[Prompt]:
    """Every record of `rl.prompts`, tokenized with the run's tokenizer (that of the prepared data in
    `data_dir`); a record that cannot be prompted is a one-line error naming its index."""
    tokenizer = load_tokenizer(read_meta(data_dir)["tokenizer"], data_dir)
    encoder = _Encoder(tokenizer, data_dir)
    prompts = []
    for index, record in enumerate(_records(Path(rl.prompts))):
        where = f"{FIELD} record {index}"
        text, ids = encoder.encode(record, where)
        stop = tuple(encoder.template.stop) if "messages" in record and encoder.template else ()
        if not ids:
            raise UserError(f"{where}: the prompt has no tokens: give it text, or leave the record out")
        if len(ids) + rl.max_new_tokens > block_size:
            raise UserError(
                f"{where}: {len(ids)} prompt tokens + rl.max_new_tokens = {rl.max_new_tokens} exceed "
                f"model.block_size = {block_size}: shorten the prompt or lower rl.max_new_tokens"
            )
        prompts.append(Prompt(index, ids, text, _answer(record, where), stop))
    if not prompts:
        raise UserError(f"{FIELD} = {rl.prompts} holds no records: give it at least one prompt")
    return prompts


class _Encoder:
    """A record's prompt as text and tokens; the chat template is loaded at the first `messages` record."""

    def __init__(self, tokenizer: Tokenizer, data_dir: Path) -> None:
        self.tokenizer, self.data_dir = tokenizer, data_dir
        self.template: ChatTemplate | None = None

    def encode(self, record: dict, where: str) -> tuple[str, list[int]]:
        prompt, messages = record.get("prompt"), record.get("messages")
        if prompt is not None and messages is not None:
            raise UserError(f"{where} has both `prompt` and `messages`: keep one")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise UserError(f"{where}: `prompt` is {type(prompt).__name__}, not a string: fix the record")
            return prompt, self.tokenizer.encode(prompt)
        if messages is None:
            raise UserError(
                f"{where} has neither a `prompt` string nor a `messages` list (it has {sorted(record)}): add one"
            )
        if not isinstance(messages, list):
            raise UserError(f"{where}: `messages` is {type(messages).__name__}, not a list of messages: fix it")
        messages = check_messages(messages, where, "messages")
        if self.template is None:
            first = where.removeprefix(f"{FIELD} ")
            instead = f"give the records `prompt` strings instead of `messages` (the first with messages: {first})"
            self.template = ChatTemplate(self.data_dir, option=FIELD, instead=instead)
        text = self.template.render(messages)
        if text == self.template.render(messages, generation_prompt=False):
            raise UserError(
                f"{where}: the run's chat template adds no generation prompt after the messages, so a completion "
                "would continue the last turn: use a template that opens the assistant's turn "
                "(`add_generation_prompt`)"
            )
        return text, self.template.encode(text)


def _answer(record: dict, where: str) -> str | None:
    answer = record.get("answer")
    if answer is None or isinstance(answer, str):
        return answer
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        return str(answer)
    raise UserError(f"{where}: `answer` is {type(answer).__name__}: give it as a string or a number")


def _records(path: Path) -> Iterator[dict]:
    """The records of a prompts file, a folder of them or a saved dataset, in order."""
    if not path.exists():
        raise UserError(f"{FIELD} = {path} does not exist: point it at a JSONL or Parquet file or a datasets folder")
    if path.is_dir() and any((path / name).is_file() for name in SAVED_DATASET_FILES):
        yield from _saved_dataset(path)
        return
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES))
    for file in files if path.is_dir() else [path]:
        if file.name.endswith(PARQUET_SUFFIXES):
            yield from _parquet(file)
        elif file.name.endswith(JSONL_SUFFIXES):
            yield from _jsonl(file)
        else:
            raise UserError(f"{FIELD} = {file} is neither JSONL (.jsonl, .json, .ndjson) nor Parquet: convert it")
    if path.is_dir() and not files:
        raise UserError(f"{FIELD} = {path} is a folder with no JSONL or Parquet file nor a saved dataset")


def _jsonl(path: Path) -> Iterator[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if not isinstance(record, dict):
                    raise UserError(f"{FIELD}: {path}:{number} is not a JSON object: write one record per line")
                yield record
    except UnicodeDecodeError:
        raise UserError(f"{FIELD} = {path} is not UTF-8 JSON lines: convert it") from None
    except OSError as e:
        raise UserError(f"{FIELD} = {path} cannot be read: {e.strerror}") from None


def _parquet(path: Path) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{FIELD} = {path} is not a readable Parquet file ({e}): rewrite it") from None
    yield from table.to_pylist()


def _saved_dataset(path: Path) -> Iterator[dict]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises several types for a folder it cannot read
        raise UserError(f"{FIELD} = {path} is not a readable saved dataset ({e}): save it with save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise UserError(
                f"{FIELD} = {path} holds the splits {sorted(loaded)} and no `train`: save the split to train on alone"
            )
        loaded = loaded["train"]
    yield from loaded
