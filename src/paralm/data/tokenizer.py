"""Tokenizers: raw bytes (vocabulary 256, nothing to train), byte-level BPE trained locally, and any
pretrained Hugging Face `tokenizer.json` (or tokenizer folder), copied into the dataset that used it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from paralm.errors import UserError

BPE_FILE = "tokenizer.json"
SPECIALS_FILE = "tokenizer_config.json"
END_OF_TEXT = "<|endoftext|>"
# Where a bare tokenizer.json names no special tokens, these are how the common families spell them.
EOT_NAMES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int | None
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def save(self, directory: Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: any text round-trips, and a run needs no tokenizer file."""

    name = "byte"
    vocab_size = 256
    eot_id = None
    bos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        """Nothing to save: the byte tokenizer has no learned state."""


class BPETokenizer:
    """GPT-2-style byte-level BPE from Hugging Face `tokenizers`, with one end-of-text token."""

    name = "bpe"
    bos_id = None

    def __init__(self, tokenizer) -> None:  # a tokenizers.Tokenizer
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot_id = tokenizer.token_to_id(END_OF_TEXT)

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` itself (worker processes and export rebuild it from its JSON)."""
        return self._tokenizer

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
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids))

    def save(self, directory: Path) -> None:
        self._tokenizer.save(str(directory / BPE_FILE))


class PretrainedTokenizer(BPETokenizer):
    """A user's `tokenizer.json` (any model type): its end-of-text and beginning-of-sequence tokens come
    from a `tokenizer_config.json` beside it, else from the names the common families use."""

    name = "hf"

    def __init__(self, tokenizer, eos: str | None, bos: str | None, chat_template: str | None = None) -> None:
        super().__init__(tokenizer)
        self.eos, self.bos, self.chat_template = eos, bos, chat_template
        self.eot_id = None if eos is None else tokenizer.token_to_id(eos)
        self.bos_id = None if bos is None or bos == eos else tokenizer.token_to_id(bos)

    @classmethod
    def from_path(cls, path: Path) -> PretrainedTokenizer:
        """A `tokenizer.json` file, or a folder holding one (and maybe `tokenizer_config.json`)."""
        from tokenizers import Tokenizer

        file = path / BPE_FILE if path.is_dir() else path
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises its own exception types for a bad file
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"tokenizer {file} does not parse as a tokenizer.json ({reason}): pass a valid one"
            ) from None  # noqa: E501
        names = _read_config(file.parent / SPECIALS_FILE)
        eos, bos = _special_names(names, tokenizer)
        template = names.get("chat_template")
        return cls(tokenizer, eos, bos, template if isinstance(template, str) else None)

    def save(self, directory: Path) -> None:
        super().save(directory)
        specials = {"eos_token": self.eos, "bos_token": self.bos if self.bos_id is not None else None}
        if self.chat_template:  # kept with the data: `generate --chat` and export use it
            specials["chat_template"] = self.chat_template
        (directory / SPECIALS_FILE).write_text(json.dumps(specials, indent=1))


def _read_config(config: Path) -> dict:
    if not config.is_file():
        return {}
    try:
        names = json.loads(config.read_text())
    except ValueError:
        raise UserError(f"{config} is not JSON: fix it or remove it") from None
    return names if isinstance(names, dict) else {}


def _special_names(names: dict, tokenizer) -> tuple[str | None, str | None]:
    vocab = tokenizer.get_vocab()
    found = []
    for key, defaults in (("eos_token", EOT_NAMES), ("bos_token", BOS_NAMES)):
        value = names.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if value is None and key not in names:
            value = next((n for n in defaults if n in vocab), None)
        found.append(value if value in vocab else None)
    return found[0], found[1]


def load_tokenizer(name: str, directory: Path) -> Tokenizer:
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe":
        return BPETokenizer.load(directory)
    if name == "hf":
        return PretrainedTokenizer.from_path(directory)
    raise UserError(f"{directory}: unknown tokenizer {name!r} in its metadata: prepare the data again")
