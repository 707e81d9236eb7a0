"""Tokenizers: raw bytes (vocabulary 256, nothing to train) and byte-level BPE trained locally."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from paralm.errors import UserError

BPE_FILE = "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def save(self, directory: Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: any text round-trips, and a run needs no tokenizer file."""

    name = "byte"
    vocab_size = 256
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        """Nothing to save: the byte tokenizer has no learned state."""


class BPETokenizer:
    """GPT-2-style byte-level BPE from Hugging Face `tokenizers`, with one end-of-text token."""

    name = "bpe"

    def __init__(self, tokenizer) -> None:  # a tokenizers.Tokenizer
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot_id = tokenizer.token_to_id(END_OF_TEXT)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise UserError(f"BPE vocabulary size {vocab_size} must exceed the 256 byte tokens")
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def load(cls, directory: Path) -> BPETokenizer:
        from tokenizers import Tokenizer

        path = directory / BPE_FILE
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises its own exception types for a bad file
            raise UserError(f"tokenizer file {path} is missing or unreadable ({e}): prepare the data again") from None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids))

    def save(self, directory: Path) -> None:
        self._tokenizer.save(str(directory / BPE_FILE))


def load_tokenizer(name: str, directory: Path) -> Tokenizer:
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        return BPETokenizer.load(directory)
    raise UserError(f"{directory}: unknown tokenizer {name!r} in its metadata: prepare the data again")
