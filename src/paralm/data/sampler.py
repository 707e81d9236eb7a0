"""Which windows each rank reads: a global sample sequence that does not depend on the layout.

Sample i of a run is window `hash(seed, i) mod num_windows`, a pure function of (seed, i). Step t
consumes samples [position, position + global_batch), and data-parallel rank r takes its contiguous
slice of them, cut into micro-batches. The only state is `position`, the number of samples consumed
so far: a run resumed on a different number of ranks continues the very same sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele et al. 2014): a bijective mix with good avalanche, vectorised."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return x ^ (x >> np.uint64(31))


def _hashes(seed: int, indices: np.ndarray) -> np.ndarray:
    key = _splitmix64(np.array([seed], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        return _splitmix64(indices.astype(np.uint64) ^ key)


def sample_windows(seed: int, start: int, count: int, num_windows: int) -> np.ndarray:
    """Window indices of samples start .. start + count - 1 of the stream keyed by `seed`."""
    return windows_at(seed, np.arange(start, start + count, dtype=np.uint64), num_windows)


def windows_at(seed: int, indices: np.ndarray, num_windows: int) -> np.ndarray:
    """Window indices of the given samples of the stream keyed by `seed`."""
    return (_hashes(seed, indices) % np.uint64(num_windows)).astype(np.int64)


def uniform_at(seed: int, indices: np.ndarray) -> np.ndarray:
    """A number in [0, 1) for each of the given samples of the stream keyed by `seed` (53 random bits)."""
    return (_hashes(seed, indices) >> np.uint64(11)).astype(np.float64) / float(2**53)


@dataclass(frozen=True)
class BatchLayout:
    """How one global batch is divided: dp ranks × grad_accum micro-steps × micro_batch_size."""

    dp_size: int
    grad_accum: int
    micro_batch_size: int

    @property
    def global_batch(self) -> int:
        return self.dp_size * self.grad_accum * self.micro_batch_size

    def micro_batch_starts(self, position: int, dp_rank: int) -> list[int]:
        """First sample index of each of `dp_rank`'s micro-batches in the step starting at `position`."""
        first = position + dp_rank * self.grad_accum * self.micro_batch_size
        return [first + k * self.micro_batch_size for k in range(self.grad_accum)]
