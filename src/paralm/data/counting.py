"""What `data prepare` counts as it streams: exact duplicates dropped, progress on a terminal, the
conversations over the length limit, and the roles conversations use."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

from paralm.data.chat import Chat, LengthLimit
from paralm.data.tokenize_pool import Encoded


class Unique:
    """The documents with exact duplicates dropped (a set of 16-byte digests: memory grows with the
    number of distinct documents, not their size)."""

    def __init__(self, documents: Iterable[str]) -> None:
        self.documents, self.dropped, self._seen = documents, 0, set()

    def __iter__(self) -> Iterator[str]:
        for text in self.documents:
            digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
            if digest in self._seen:
                self.dropped += 1
                continue
            self._seen.add(digest)
            yield text


class Progress:
    """Documents, tokens and MB/s on a terminal (nothing when stderr is not one)."""

    def __init__(self, name: str) -> None:
        self.documents = self.tokens = self.text_bytes = self.long = self.dropped = 0
        self.started = time.perf_counter()
        self.bar = tqdm(desc=f"tokenizing ({name})", unit="doc", disable=not sys.stderr.isatty())

    def update(self, encoded: Encoded) -> None:
        self.documents += encoded.documents
        self.long += encoded.long
        self.dropped += encoded.dropped
        self.tokens += len(encoded.train.tokens) + len(encoded.val.tokens)
        self.text_bytes += encoded.text_bytes
        seconds = max(time.perf_counter() - self.started, 1e-9)
        self.bar.update(encoded.documents)
        self.bar.set_postfix_str(f"{self.tokens:,} tokens, {self.text_bytes / seconds / 1e6:.1f} MB/s", refresh=False)

    def close(self) -> None:
        self.bar.close()

    def long_record(self, limit: LengthLimit) -> dict:
        """What meta.json says of the conversations over the limit."""
        return {"max_tokens": limit.max_tokens, "long": limit.long, "count": self.long, "dropped": self.dropped}


# What other formats name the roles paralm's conversations use (ShareGPT's `human`/`gpt`, Gemma's `model`).
ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant"}
MAX_ROLES = 64  # distinct role names kept: enough to explain, bounded whatever the data


class Roles:
    """The conversations of `inputs`, with how often each role occurs: why conversations that train no
    token train none."""

    def __init__(self, chats: Iterable[Chat], inputs: list[Path]) -> None:
        self.chats, self.inputs, self.counts = chats, inputs, {}

    def __iter__(self) -> Iterator[Chat]:
        for chat in self.chats:
            for message in chat.messages:
                role = message["role"]
                if role in self.counts or len(self.counts) < MAX_ROLES:
                    self.counts[role] = self.counts.get(role, 0) + 1
            yield chat

    def untrained(self) -> str:
        """The refusal of conversations that train no token: the inputs, the likely cause and its fix."""
        first, more = self.inputs[0], len(self.inputs) - 1
        return f"{first}{f' (and {more} more inputs)' if more else ''}: no token to train on: {self._cause()}"

    def _cause(self) -> str:
        if "assistant" in self.counts:
            return (
                f"the chat template marks no train token of its {self.counts['assistant']} 'assistant' turns "
                "(they are all in validation, or its {% generation %} blocks hold none): check the template"
            )
        mapped = {r: _meant(r) for r in sorted(self.counts, key=lambda r: _meant(r) == "assistant") if _meant(r) != r}
        if "assistant" in mapped.values():
            fixes = ", ".join(f"{role} to {meant}" for role, meant in mapped.items())
            named = f"role{'s' * (len(mapped) > 1)} {'/'.join(mapped)}"
            return f"{named}: paralm trains the turns of role 'assistant' (roles user/assistant): map {fixes}"
        return (
            f"no message has role 'assistant' (roles: {', '.join(sorted(self.counts))}): the loss trains the "
            "assistant's turns only: add them"
        )


def _meant(role: str) -> str:
    """The role paralm's conversations call this one (itself where unknown)."""
    low = role.lower()
    return low if low in ("system", "user", "assistant") else ALIASES.get(low, role)
