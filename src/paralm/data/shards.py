"""Token shards: flat arrays of token ids on disk, memory-mapped for reading.

A prepared dataset is a folder with `meta.json`, the tokenizer (if it has state) and, per split,
files `train_000000.bin`, ... of at most `SHARD_TOKENS` tokens each. Memory-mapping means a rank
touches only the pages of the windows it samples, whatever the corpus size. `meta.json` carries
paralm's marker (`MARKER`), so `data prepare --out` knows a folder it may replace from someone
else's folder that merely holds a `meta.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from paralm.data.tokenizer import Tokenizer, load_tokenizer
from paralm.errors import UserError

META_FILE = "meta.json"
FORMAT_VERSION = 1
SHARD_TOKENS = 100_000_000
# The field only paralm writes into a dataset's meta.json (from the version that added it on).
MARKER = ("written_by", "paralm data prepare")
# Every field an unmarked format-1 meta.json had, no more and no fewer: how a dataset prepared before
# the marker is still recognised as paralm's.
UNMARKED_FIELDS = frozenset(
    {"format", "tokenizer", "vocab_size", "dtype", "documents", "val_fraction", "splits", "shard_tokens"}
)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class ShardWriter:
    """Appends token arrays to a split, starting a new shard file every `shard_tokens` tokens."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[str] = []
        self.tokens = 0
        self._file = None
        self._in_shard = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None or self._in_shard == self.shard_tokens:
                self._open_next()
            take = min(len(tokens), self.shard_tokens - self._in_shard)
            tokens[:take].tofile(self._file)
            self._in_shard += take
            self.tokens += take
            tokens = tokens[take:]

    def _open_next(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.shards):06d}.bin"
        self.shards.append(name)
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 - closed in close()
        self._in_shard = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_meta(directory: Path) -> dict:
    path = directory / META_FILE
    if not path.is_file():
        raise UserError(
            f"{directory} is not a prepared dataset (no {META_FILE}): "
            "create it with `paralm data prepare --input ... --out DIR` or set data.path to such a folder"
        )
    try:
        meta = json.loads(path.read_text())
    except ValueError:
        raise UserError(f"{path} is corrupt: prepare the data again") from None
    if meta.get("format") != FORMAT_VERSION:
        raise UserError(f"{path} has format {meta.get('format')!r}, expected {FORMAT_VERSION}: prepare it again")
    return meta


def written_by_paralm(meta: object) -> bool:
    """Whether a parsed meta.json is one paralm's `data prepare` wrote: it has the marker, or (written
    before the marker) exactly the fields that version wrote, at format 1."""
    if not isinstance(meta, dict):
        return False
    key, value = MARKER
    return meta.get(key) == value or (set(meta) == UNMARKED_FIELDS and meta.get("format") == FORMAT_VERSION)


class TokenDataset:
    """One split of a prepared dataset as windows of `block_size + 1` tokens (inputs and targets)."""

    def __init__(self, directory: str | Path, split: str, block_size: int) -> None:
        self.directory = Path(directory)
        self.meta = read_meta(self.directory)
        self.block_size = block_size
        dtype = np.dtype(self.meta["dtype"])
        self.shards = []
        for name in self.meta["splits"][split]["shards"]:
            path = self.directory / name
            expected = self.meta["shard_tokens"][name]
            if not path.is_file() or path.stat().st_size != expected * dtype.itemsize:
                raise UserError(f"shard {path} is missing or truncated: prepare the data again")
            self.shards.append(np.memmap(path, dtype=dtype, mode="r"))
        windows = [max(len(s) - block_size, 0) for s in self.shards]
        self._ends = np.cumsum(windows)
        if self.num_windows == 0:
            raise UserError(
                f"the {split} split of {self.directory} has fewer than block_size + 1 = {block_size + 1} "
                "tokens in every shard: use more text, a larger data.val_fraction or a smaller model.block_size"
            )

    @property
    def num_windows(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.meta["tokenizer"], self.directory)

    def batch(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (len(windows), block_size), for global window indices."""
        shard_ids = np.searchsorted(self._ends, windows, side="right")
        starts = windows - np.concatenate(([0], self._ends))[shard_ids]
        rows = np.stack(
            [self.shards[s][o : o + self.block_size + 1] for s, o in zip(shard_ids, starts, strict=True)]
        ).astype(np.int64)
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1], tokens[:, 1:]
