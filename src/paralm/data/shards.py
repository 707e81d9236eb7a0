"""Token shards: flat arrays of token ids on disk, memory-mapped for reading.

A prepared dataset is a folder with `meta.json`, the tokenizer (if it has state) and, per split,
files `train_000000.bin`, ... of at most `SHARD_TOKENS` tokens each. Beside each shard: `.docs`, the
offsets (int64) where its documents start, so packed windows can keep attention inside a document
(`data.document_mask`); and for chat data `.mask`, one uint8 per token, 1 where the loss trains on it
(the assistant's turns). Memory-mapping means a rank touches only the pages of the windows it samples,
whatever the corpus size. `meta.json` carries
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


IGNORE = -100  # a target the loss skips (`F.cross_entropy`'s default ignore_index)
DOCS_SUFFIX, MASK_SUFFIX = ".docs", ".mask"


def companion(shard: str, suffix: str) -> str:
    """The name of a shard's document-starts or loss-mask file."""
    return shard.removesuffix(".bin") + suffix


def dataset_files(meta: dict) -> set[str]:
    """Every shard file a prepared dataset's meta.json lists, with their document starts and masks."""
    shards = meta.get("shard_tokens")
    shards = list(shards) if isinstance(shards, dict) else []
    suffixes = ([DOCS_SUFFIX] if meta.get("document_starts") else []) + ([MASK_SUFFIX] if meta.get("loss_mask") else [])
    return {*shards, *(companion(name, suffix) for name in shards for suffix in suffixes)}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class ShardWriter:
    """Appends token arrays to a split, starting a new shard file every `shard_tokens` tokens; beside
    each shard, its documents' start offsets and (chat data) the loss mask."""

    def __init__(
        self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS, masked: bool = False
    ) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.masked = masked
        self.shards: list[str] = []
        self.tokens = self.trained = 0  # trained: tokens the loss mask marks
        self._files: list = []
        self._in_shard = 0

    def write(self, tokens: np.ndarray, starts: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append `tokens`, whose documents begin at offsets `starts` (sorted), with their loss mask."""
        tokens = tokens.astype(self.dtype, copy=False)
        starts = np.asarray(starts, dtype=np.int64)
        while len(tokens):
            if not self._files or self._in_shard == self.shard_tokens:
                self._open_next()
            take = min(len(tokens), self.shard_tokens - self._in_shard)
            tokens[:take].tofile(self._files[0])
            here = starts[starts < take]
            (here + self._in_shard).tofile(self._files[1])
            if self.masked:
                mask[:take].astype(np.uint8, copy=False).tofile(self._files[2])
                self.trained += int(np.count_nonzero(mask[:take]))
                mask = mask[take:]
            self._in_shard += take
            self.tokens += take
            tokens, starts = tokens[take:], starts[len(here) :] - take

    def _open_next(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.shards):06d}.bin"
        self.shards.append(name)
        names = [name, companion(name, DOCS_SUFFIX)] + ([companion(name, MASK_SUFFIX)] if self.masked else [])
        self._files = [open(self.directory / n, "wb") for n in names]  # noqa: SIM115 - closed in close()
        self._in_shard = 0

    def close(self) -> None:
        for file in self._files:
            file.close()
        self._files = []


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


def check_trains(directory: Path, meta: dict) -> None:
    """Chat data whose train split the loss mask marks no token of: a run on it would log loss 0 and learn
    nothing. The count is meta.json's (per split since it was kept so; before, for both splits together)."""
    if not meta.get("loss_mask"):
        return
    trained = meta["splits"]["train"].get("trained_tokens", meta.get("trained_tokens"))
    if trained == 0:
        raise UserError(
            f"{directory}: no token of its train split is an assistant's (trained_tokens 0 in {META_FILE}), so "
            "training would learn nothing: prepare it again from conversations with role 'assistant' turns"
        )


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
        self.shards, self.starts, self.masks = [], [], []
        for name in self.meta["splits"][split]["shards"]:
            expected = self.meta["shard_tokens"][name]
            self.shards.append(_mapped(self.directory / name, dtype, expected))
            if self.has_documents:
                self.starts.append(np.fromfile(self.directory / companion(name, DOCS_SUFFIX), dtype=np.int64))
            if self.has_loss_mask:
                self.masks.append(_mapped(self.directory / companion(name, MASK_SUFFIX), np.dtype(np.uint8), expected))
        if split == "train":
            check_trains(self.directory, self.meta)
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

    @property
    def has_loss_mask(self) -> bool:
        """Chat data: the loss trains only on the tokens its mask marks."""
        return bool(self.meta.get("loss_mask"))

    @property
    def has_documents(self) -> bool:
        """Where documents start is stored (datasets prepared before it was are not)."""
        return bool(self.meta.get("document_starts"))

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.meta["tokenizer"], self.directory)

    def _locate(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard_ids = np.searchsorted(self._ends, windows, side="right")
        return shard_ids, windows - np.concatenate(([0], self._ends))[shard_ids]

    def batch(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (len(windows), block_size), for global window indices;
        with a loss mask, the targets it does not train on are `IGNORE`."""
        shard_ids, starts = self._locate(windows)
        pairs = list(zip(shard_ids, starts, strict=True))
        rows = np.stack([self.shards[s][o : o + self.block_size + 1] for s, o in pairs]).astype(np.int64)
        tokens = torch.from_numpy(rows)
        x, y = tokens[:, :-1], tokens[:, 1:]
        if self.has_loss_mask:
            trained = np.stack([self.masks[s][o + 1 : o + self.block_size + 1] for s, o in pairs]).astype(bool)
            y = y.masked_fill(torch.from_numpy(~trained), IGNORE)
        return x, y

    def trained_tokens(self, windows: np.ndarray) -> int:
        """How many targets of these windows the loss trains on (reads only the masks)."""
        if not self.has_loss_mask:
            return len(windows) * self.block_size
        shard_ids, starts = self._locate(windows)
        return int(
            sum(
                np.count_nonzero(self.masks[s][o + 1 : o + self.block_size + 1])
                for s, o in zip(shard_ids, starts, strict=True)
            )
        )

    def documents(self, windows: np.ndarray) -> torch.Tensor:
        """Which document each input token belongs to, (len(windows), block_size): 0 for the document the
        window starts in, counting up at each stored document start."""
        if not self.has_documents:
            raise UserError(
                f"data.document_mask needs the document starts that {self.directory} lacks (prepared by an "
                "older paralm): prepare the data again"
            )
        shard_ids, starts = self._locate(windows)
        rows = []
        for s, o in zip(shard_ids, starts, strict=True):
            first = np.searchsorted(self.starts[s], o, side="right")
            ids = np.searchsorted(self.starts[s], np.arange(o, o + self.block_size), side="right") - first
            rows.append(ids)
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def _mapped(path: Path, dtype: np.dtype, expected: int) -> np.memmap:
    if not path.is_file() or path.stat().st_size != expected * dtype.itemsize:
        raise UserError(f"shard {path} is missing or truncated: prepare the data again")
    return np.memmap(path, dtype=dtype, mode="r")
