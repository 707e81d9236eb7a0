"""Which positions of each sequence a cp rank holds, and its share of a batch.

Ring attention takes the zig-zag (load-balanced) layout: the sequence in 2·cp chunks, rank r holding
chunks r and 2·cp-1-r, so under the causal mask every rank attends to as many (query, key) pairs. The
all-to-all takes contiguous chunks (rank r the r-th of cp), which its exchange puts back in order.
A batch's loss is then the sum of the cp ranks' shares, added up over their `group`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceShard:
    rank: int  # this rank's place in the cp group
    cp: int
    zigzag: bool  # ring attention's layout; contiguous chunks otherwise
    group: dist.ProcessGroup | None = None  # the cp ranks, holding the other shares (None: the layout alone)

    @property
    def chunks(self) -> int:
        """How many equal chunks each sequence is cut into: what block_size must divide by."""
        return 2 * self.cp if self.zigzag else self.cp

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The global positions (in the order held) of this rank's share of a sequence of `length` tokens."""
        size = length // self.chunks
        starts = (self.rank, 2 * self.cp - 1 - self.rank) if self.zigzag else (self.rank,)
        return torch.cat([torch.arange(s * size, (s + 1) * size, device=device) for s in starts])

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens and targets of a (batch, seq) batch, and their global positions."""
        positions = self.positions(x.shape[1], x.device)
        return x[:, positions], y[:, positions], positions
