"""Each rank's slices of a Hugging Face folder's tensors, read straight into its parameters' shards.

The family says where each of its tensors lies in the folder's (`HFPiece`: whole, one expert of a stack,
at an offset in a fused tensor, transposed, or with its rows in another order). For every piece whose
tensor this rank holds, `_read_of` turns the rank's shard (a DTensor's local tensor and its offsets, or
a whole tensor) into the block of the HF tensor it covers, and a destination: a view of the shard, so
the values land in place, or, for rows out of order, a buffer over the rows' span, gathered after. DCP
plans those blocks (`_SlicePlanner`) and torch's `HuggingFaceStorageReader` reads each with safetensors'
`get_slice`: a rank holding experts [e0, e1) opens only their per-expert tensors, and a ZeRO-3 or TP
shard reads only its rows or columns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from paralm.errors import UserError
from paralm.models.hf_folder import HFFolder
from paralm.models.spec import HFPiece

_Shard = tuple[torch.Tensor, tuple[int, ...]]  # this rank's part of a tensor, and where it starts in the whole


@dataclass(frozen=True)
class _Read:
    """One block of an HF tensor, `theirs` from `offsets` and as large as `dest`, read into `dest` (in theirs'
    orientation): a view of the shard, or of a buffer whose rows `gather` then copies into the shard."""

    theirs: str
    offsets: tuple[int, ...]
    dest: torch.Tensor
    gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (shard, buffer, rows): shard = buffer[rows]

    def finish(self) -> None:
        if self.gather is not None:
            shard, buffer, rows = self.gather
            shard.copy_(buffer[rows])


@torch.no_grad()
def read_slices(
    folder: HFFolder, pieces: list[HFPiece], state: dict[str, torch.Tensor], group: dist.ProcessGroup | None
) -> None:
    """Fill this rank's shards of `state` (paralm name -> tensor or DTensor) with their slices of the folder's
    tensors, as `pieces` place them. Collective."""
    shards = {name: _shard(state[name]) for name in {piece.ours for piece in pieces}}
    reads = [read for piece in pieces if (read := _read_of(piece, shards[piece.ours])) is not None]
    try:
        dcp.load({}, storage_reader=_FolderReader(folder), planner=_SlicePlanner(reads), process_group=group)
    except CheckpointException as e:
        rank, (error, _) = next(iter(sorted(e.failures.items())))
        raise UserError(f"{folder.path} cannot be read (rank {rank}: {str(error).splitlines()[0][:200]})") from None
    for read in reads:
        read.finish()


def _shard(value: torch.Tensor) -> _Shard | None:
    """This rank's part of `value` and its offsets in the whole; None where the rank holds none of it."""
    if not isinstance(value, DTensor):
        return value, (0,) * value.dim()
    if value.device_mesh.get_coordinate() is None:
        return None
    (chunk,) = value.__create_chunk_list__()  # DCP's own account of the local shard's place
    return value.to_local(), tuple(chunk.offsets)


def _read_of(piece: HFPiece, held: _Shard | None) -> _Read | None:
    """The block of `piece.theirs` this rank's shard of `piece.ours` needs, None where it needs none."""
    if held is None:
        return None
    local, start = held
    if piece.expert is not None:
        index = piece.expert - start[0]
        if not 0 <= index < local.shape[0]:
            return None
        local, start = local[index], start[1:]
    if local.numel() == 0:
        return None
    offsets = [s + o for s, o in zip(start, piece.offset or (0,) * len(start), strict=True)]
    dest, gather = local, None
    if piece.rows is not None:
        wanted = piece.rows[start[0] : start[0] + local.shape[0]]
        offsets[0] = low = int(wanted.min())
        if not torch.equal(wanted, torch.arange(low, low + len(wanted))):  # out of order: read the span
            dest = local.new_empty((int(wanted.max()) + 1 - low, *local.shape[1:]))
            gather = (local, dest, (wanted - low).to(local.device))
    if piece.transposed:
        dest, offsets = dest.t(), offsets[::-1]
    return _Read(piece.theirs, tuple(offsets), dest, gather)


class _SlicePlanner(DefaultLoadPlanner):
    """DCP's load planner for `_Read`s: one chunk of an HF tensor each, copied into its destination."""

    def __init__(self, reads: list[_Read]) -> None:
        super().__init__()
        self.reads = {(read.theirs, read.offsets): read for read in reads}

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for (name, offsets), read in self.reads.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=read.dest.shape)
            items += create_read_items_for_chunk_list(name, self.metadata.state_dict_metadata[name], [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = self.reads[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))].dest
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)
        return tensor


class _FolderReader(dcp.HuggingFaceStorageReader):
    """torch's safetensors reader limited to the files `read_folder` chose: by itself it reads every
    `*.safetensors` in the folder, so a stale `model.safetensors` beside shards (or an adapter file) would
    mix in other weights than `paralm import` and transformers read."""

    def __init__(self, folder: HFFolder) -> None:
        super().__init__(str(folder.path))
        self.fs = _Listing(sorted({str(file) for file in folder.files.values()}))


class _Listing(FileSystem):
    """A file system whose folder listing is the files given (the reader finds its files by listing)."""

    def __init__(self, files: list[str]) -> None:
        super().__init__()
        self.files = files

    def ls(self, path: str | os.PathLike) -> list[str]:
        return list(self.files)
