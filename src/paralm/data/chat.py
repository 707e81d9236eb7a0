"""Conversations rendered with the tokenizer's own chat template, and the loss mask that trains on the
assistant's turns only.

The template (`chat_template` in the tokenizer folder's `tokenizer_config.json`) runs through Hugging
Face transformers' template engine, so a conversation is tokenized exactly as the model will later be
prompted. The mask is 1 on every token that overlaps an assistant turn (its content and end-of-turn
token), 0 elsewhere. Templates with `{% generation %}` markers say where the turns are; for the others
each turn's characters are found by rendering prefixes: the conversation before the turn (with the
generation prompt) and up to its end. A token that straddles a turn's edge (a BPE merge across the
template's text and the content) is trained on, as transformers marks it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paralm.errors import UserError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


LONG_POLICIES = ("truncate", "drop")


@dataclass(frozen=True)
class LengthLimit:
    """`--max-tokens` and `--long`: packed training cuts a conversation longer than a window into pieces
    whose later ones lose the prompt, so such a conversation is cut to its first `max_tokens` tokens
    (`truncate`; one that keeps no assistant token is dropped) or left out (`drop`)."""

    max_tokens: int
    long: str = "truncate"

    def apply(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The conversation within the limit, or None where it is left out."""
        if len(ids) <= self.max_tokens:
            return ids, mask
        if self.long == "drop" or not mask[: self.max_tokens].any():
            return None
        return ids[: self.max_tokens], mask[: self.max_tokens]

    def note(self, long: int, dropped: int, conversations: int) -> str:
        """The one line `prepare` says when conversations were over the limit."""
        cut = f"{long - dropped} truncated, " if self.long == "truncate" else ""
        return (
            f"paralm data prepare: {long} of {conversations} conversations are longer than --max-tokens "
            f"{self.max_tokens}: {cut}{dropped} dropped (--long {self.long})"
        )


@dataclass(frozen=True)
class Chat:
    """One conversation and where it was read (`file:line`), for error messages."""

    where: str
    messages: list[dict]


def check_messages(messages: object, where: str, field: str) -> list[dict]:
    """The messages of a row, each content as text, or a user error naming the row and what is wrong."""
    if isinstance(messages, list) and not messages:
        raise UserError(f"{where}: {field!r} is an empty list: a conversation needs messages; leave the row out")
    if not isinstance(messages, list):
        raise UserError(f"{where}: {field!r} is not a list of messages: set --messages-field")
    checked = []
    for number, message in enumerate(messages):
        missing = [k for k in ("role", "content") if not isinstance(message, dict) or k not in message]
        if missing:
            raise UserError(
                f"{where}: message {number} has no {' or '.join(map(repr, missing))}: "
                'each message needs {"role": ..., "content": ...}'
            )
        if not isinstance(message["role"], str):
            raise UserError(f"{where}: message {number}'s role is not a string: fix the row")
        content = message["content"]
        if not isinstance(content, str):
            message = {**message, "content": _text(content, f"{where}: message {number}")}
        checked.append(message)
    return checked


def _text(content: object, where: str) -> str:
    """A message's content parts as one text (their text parts joined, as chat templates join them)."""
    if content is None:
        raise UserError(f"{where}'s content is null: give it text, or leave the message out")
    if not isinstance(content, list):
        raise UserError(f"{where}'s content ({type(content).__name__}) is neither text nor a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict):
            raise UserError(f'{where}\'s content parts are not objects like {{"type": "text", "text": ...}}')
        if part.get("type", "text") != "text":
            raise UserError(f"{where} has a content part of type {part['type']!r}: paralm trains on text only")
        if not isinstance(part.get("text"), str):
            raise UserError(f'{where} has a text part without a "text" string: fix the row')
        texts.append(part["text"])
    return "".join(texts)


class ChatRenderer:
    """A tokenizer folder's chat template, tokenizing conversations with their loss masks."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.tokenizer = _load(directory)
        template = self.tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise UserError(
                f"--chat: the tokenizer {directory} has no chat template: add a `chat_template` to its "
                "tokenizer_config.json, or prepare the text without --chat"
            )
        self.has_markers = bool(GENERATION_TAG.search(template))

    def _render(self, messages: list[dict], where: str, **options: bool) -> object:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, **options)
        except TemplateError as e:
            raise UserError(
                f"{where}: the chat template of {self.directory} rejects this conversation ({_line(e)}): fix the row"
            ) from None
        except Exception as e:  # the template is the user's code: what it raises is about it or the row
            raise UserError(
                f"{where}: the chat template of {self.directory} fails on this conversation "
                f"({type(e).__name__}: {_line(e)}): fix the template or the row"
            ) from None

    def encode(self, chat: Chat) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and loss mask (1: an assistant token) of one conversation."""
        if self.has_markers:
            out = self._render(
                chat.messages,
                chat.where,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            return np.asarray(out["input_ids"], dtype=np.int64), np.asarray(out["assistant_masks"], dtype=np.uint8)
        return self.encode_by_prefixes(chat)

    def encode_by_prefixes(self, chat: Chat) -> tuple[np.ndarray, np.ndarray]:
        """The mask without markers: each assistant turn spans from the end of the conversation before
        it (generation prompt included) to the end of the conversation up to it (less trailing
        whitespace the template puts between turns); tokens overlapping a span are trained on."""
        text = self._render(chat.messages, chat.where, tokenize=False)
        spans = []
        for i, message in enumerate(chat.messages):
            if message["role"] != "assistant":
                continue
            before = self._render(chat.messages[:i], chat.where, tokenize=False, add_generation_prompt=True)
            upto = self._render(chat.messages[: i + 1], chat.where, tokenize=False)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise UserError(
                    f"{chat.where}: the chat template of {self.directory} renders a conversation's beginning "
                    "differently from the whole: add {% generation %} markers around the assistant's turns"
                )
            spans.append((len(before), len(upto.rstrip())))
        encoding = self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, dtype=np.int64), overlap_mask(encoding.offsets, spans)


def overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap one of the (start, end) spans."""
    edges = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(edges), dtype=bool)
    for start, end in spans:
        mask |= (edges[:, 0] < end) & (edges[:, 1] > start)
    return mask.astype(np.uint8)


def _line(error: Exception) -> str:
    """An error's message on one line."""
    return " ".join(str(error).split())


def _load(directory: Path):
    from transformers import AutoTokenizer

    folder = directory if directory.is_dir() else directory.parent
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"--chat: cannot load the tokenizer folder {folder} ({reason}): pass a tokenizer folder"
        ) from None
