"""What `data prepare` counts as it streams: exact duplicates dropped, progress on a terminal, and the
conversations over the length limit."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Iterable, Iterator

from tqdm import tqdm

from paralm.data.chat import LengthLimit
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
        self.documents = self.tokens = self.text_bytes = self.trained = self.long = self.dropped = 0
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
