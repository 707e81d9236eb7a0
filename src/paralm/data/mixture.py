"""Several prepared datasets mixed with weights (`data.mixture = ["data/a:0.7", "data/b:0.3"]`).

Global sample i comes from source s(i), drawn with the mixture's weights from a stream of its own
(a pure function of the seed and i), and takes window `hash(seed + 1 + s, i)` of that source. Like the
single-source sampler, nothing depends on the layout: the global position (samples consumed) fixes
every source's position, so a run resumed on any number of ranks continues the same sequence. The
samples each source has given so far are recorded in the checkpoint's trainer state.
"""

from __future__ import annotations

import numpy as np
import torch

from paralm.config.mixture import Source
from paralm.data.sampler import sample_windows, uniform_at, windows_at
from paralm.data.shards import TokenDataset
from paralm.data.tokenizer import BPE_FILE
from paralm.errors import UserError

# The source choice draws from its own stream, apart from every source's windows.
MIX_SEED_OFFSET = 2_000_003
COUNT_CHUNK = 1 << 20


class MixedData:
    """One split of every source; `sample` gives the inputs and targets of global samples."""

    def __init__(self, sources: list[Source], split: str, block_size: int) -> None:
        self.sources = sources
        self.datasets = [TokenDataset(s.path, split, block_size) for s in sources]
        self._bounds = np.cumsum([s.weight for s in sources])
        _check_same_tokenizer(self.datasets)

    @property
    def vocab_size(self) -> int:
        return self.datasets[0].vocab_size

    def source_of(self, seed: int, indices: np.ndarray) -> np.ndarray:
        """Which source each global sample comes from."""
        if len(self.sources) == 1:
            return np.zeros(len(indices), dtype=np.int64)
        draws = uniform_at(seed + MIX_SEED_OFFSET, indices)
        return np.minimum(np.searchsorted(self._bounds, draws, side="right"), len(self.sources) - 1)

    def _draws(self, seed: int, start: int, count: int) -> list[tuple[TokenDataset, np.ndarray, np.ndarray]]:
        """For each source: its dataset, which of the samples start .. start + count - 1 it gives, and
        their windows."""
        if len(self.datasets) == 1:  # the single-source stream, unchanged
            data = self.datasets[0]
            return [(data, np.arange(count), sample_windows(seed, start, count, data.num_windows))]
        indices = np.arange(start, start + count, dtype=np.uint64)
        which = self.source_of(seed, indices)
        draws = []
        for s, data in enumerate(self.datasets):
            rows = np.flatnonzero(which == s)
            if len(rows):
                draws.append((data, rows, windows_at(seed + 1 + s, indices[rows], data.num_windows)))
        return draws

    def sample(self, seed: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (count, block_size), of global samples start .. start + count - 1."""
        draws = self._draws(seed, start, count)
        if len(self.datasets) == 1:
            return draws[0][0].batch(draws[0][2])
        block = self.datasets[0].block_size
        x = torch.empty(count, block, dtype=torch.int64)
        y = torch.empty(count, block, dtype=torch.int64)
        for data, rows, windows in draws:
            x[rows], y[rows] = data.batch(windows)
        return x, y

    def documents(self, seed: int, start: int, count: int) -> torch.Tensor:
        """Which document each input token of these samples belongs to (`TokenDataset.documents`)."""
        ids = torch.empty(count, self.datasets[0].block_size, dtype=torch.int64)
        for data, rows, windows in self._draws(seed, start, count):
            ids[rows] = data.documents(windows)
        return ids

    @property
    def has_loss_mask(self) -> bool:
        return any(data.has_loss_mask for data in self.datasets)

    def trained_tokens(self, seed: int, start: int, count: int) -> int:
        """The targets of these samples the loss trains on, read from the masks alone (cheap enough for
        every rank to count the whole global batch)."""
        return sum(data.trained_tokens(windows) for data, _, windows in self._draws(seed, start, count))

    def positions(self, seed: int, samples_seen: int) -> dict[str, int]:
        """The samples each source has given in the first `samples_seen` of the run."""
        counts = np.zeros(len(self.sources), dtype=np.int64)
        for start in range(0, samples_seen, COUNT_CHUNK):
            indices = np.arange(start, min(start + COUNT_CHUNK, samples_seen), dtype=np.uint64)
            counts += np.bincount(self.source_of(seed, indices), minlength=len(self.sources))
        return {s.name: int(c) for s, c in zip(self.sources, counts, strict=True)}


def _check_same_tokenizer(datasets: list[TokenDataset]) -> None:
    """Token ids mean the same in every source: the same tokenizer kind, vocabulary and file."""
    first = datasets[0]
    for other in datasets[1:]:
        if _tokenizer_identity(other) != _tokenizer_identity(first):
            raise UserError(
                f"data.mixture: {other.directory} and {first.directory} were prepared with different tokenizers: "
                "prepare every source with the same --tokenizer"
            )


def _tokenizer_identity(data: TokenDataset) -> tuple:
    file = data.directory / BPE_FILE
    return data.meta["tokenizer"], data.vocab_size, file.read_bytes() if file.is_file() else None
