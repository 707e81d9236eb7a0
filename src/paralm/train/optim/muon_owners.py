"""Distributed Muon: each matrix split across ranks is orthogonalised once, by one of the ranks that share
it, and every rank takes its part of the result.

Orthogonalisation needs whole matrices (an orthogonalised shard is not a shard of the orthogonalised
matrix). As in Moonlight's Distributed Muon (Liu et al. 2025) the work is split by matrix: the ranks along
the mesh dimensions that split a DTensor inside its last two dimensions (ZeRO-1's and FSDP's row shards,
tensor parallelism's rows or columns, both at once under TP + FSDP) are its sharers; each owns a share of
the matrices, assigned costliest first to the least loaded (`assign_owners`, from the shapes alone: the
same on every rank). An owner joins its matrices, orthogonalises them and hands every sharer its rows or
columns of the results, so the result is bit-equal to one process's and Newton-Schulz falls by the number
of sharers. How the matrices travel:

- split along one mesh dimension by `Shard` (ZeRO-1/2/3, HSDP within a replica group, TP): two
  all-to-alls over that dimension's group per step, whatever the number of matrices: each rank sends each
  owner its shards of the owner's matrices, then each owner sends each rank its shards of the results.
  Each rank receives about 1/N of the matrices each way (an all-gather of every matrix receives all);
- split along two (TP + FSDP) or by `_StridedShard`: each matrix gathered along them (`redistribute`, as
  `full_tensor`) on every rank, the owner's result broadcast along them, one collective each per matrix.

The mesh dimensions that do not split a matrix keep their own copies of the work: a replicated one
(HSDP's `dp_replicate`, DDP) holds the same input on each of its ranks, and splitting there would add an
exchange over what is, in HSDP, the slow link between the replica groups, to save work those groups
do in parallel anyway; one split by expert holds other experts on each rank, orthogonalised where they
are. A tensor split by neither (one process, DDP, experts split by expert) is orthogonalised in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

Compute = Callable[[torch.Tensor], torch.Tensor]  # whole matrices in, the same shape and dtype out


def split_dims(tensor: torch.Tensor) -> tuple[int, ...]:
    """The mesh dimensions (of more than one rank) that split `tensor` inside its last two dimensions."""
    if not isinstance(tensor, DTensor):
        return ()
    mesh, first = tensor.device_mesh, tensor.ndim - 2
    return tuple(
        i
        for i, p in enumerate(tensor.placements)
        if not (p.is_replicate() or p.is_partial()) and p.dim % tensor.ndim >= first and mesh.size(i) > 1
    )


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """Relative Newton-Schulz FLOPs of a matrix or stack of them: 4m^2n + 2m^3 per matrix, m <= n."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * (4 * m * m * n + 2 * m**3)


def assign_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """Which of `ranks` owns each job: the costliest first, each to the least loaded rank (ties: the lower
    index, so the answer is the same on every rank)."""
    load, owners = [0.0] * ranks, [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        owners[job] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[job]] += costs[job]
    return owners


def orthogonalise_all(
    tensors: list[torch.Tensor], layouts: list[torch.Tensor], compute: Compute, dtype: torch.dtype
) -> list[torch.Tensor]:
    """`compute` of each of `tensors`, this rank's part of a tensor laid out as the matching DTensor (or plain
    tensor) of `layouts`; the results as local parts too, the split ones computed once each, by their owner.
    `compute` works in `dtype` (it casts its input to it first, its result comes from it), so the shards
    travel in it: bf16 halves the bytes and changes no bit. Every rank must pass tensors laid out alike in
    the same order (the exchanges are collectives)."""
    results: list[torch.Tensor | None] = [None] * len(tensors)
    shared: dict[tuple, list[int]] = {}
    for i, like in enumerate(layouts):
        dims = split_dims(like)
        if not dims:
            results[i] = compute(tensors[i])
        elif len(dims) == 1 and type(like.placements[dims[0]]) is Shard:
            shared.setdefault((_exchange, like.device_mesh, dims, like.device), []).append(i)
        else:
            shared.setdefault((_gather_and_broadcast, like.device_mesh, dims), []).append(i)
    for (way, mesh, dims, *_), jobs in shared.items():
        done = way(mesh, dims, [tensors[i] for i in jobs], [layouts[i] for i in jobs], compute, dtype)
        for i, result in zip(jobs, done, strict=True):
            results[i] = result
    return results  # type: ignore[return-value]


def _chunks(length: int, ranks: int) -> list[int]:
    """How `Shard` splits `length` over `ranks`: torch.chunk's sizes, then empty ones."""
    size = -(-length // ranks)
    return [max(0, min(size, length - r * size)) for r in range(ranks)]


def _exchange(
    mesh: DeviceMesh,
    dims: tuple[int, ...],
    tensors: list[torch.Tensor],
    layouts: list[DTensor],
    compute: Compute,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The local results of `tensors`, laid out as `layouts`, all split by `Shard` along the one mesh dimension
    `dims`, through two all-to-alls over its group: shards to their matrix's owner, the results' shards back."""
    (dim,) = dims
    group, ranks, me = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    owners = assign_owners([newton_schulz_cost(t.shape) for t in layouts], ranks)
    axes = [t.placements[dim].dim % t.ndim for t in layouts]  # the tensor dimension each is split along
    rows = [_chunks(t.shape[axis], ranks) for t, axis in zip(layouts, axes, strict=True)]
    mine = [i for i, o in enumerate(owners) if o == me]

    def shape(i: int, rank: int) -> list[int]:
        """The shard of tensor i that `rank` holds (a stack split by expert elsewhere: this group's experts)."""
        local = list(tensors[i].shape)
        local[axes[i]] = rows[i][rank]
        return local

    def all_to_all(sent: list[list[torch.Tensor]], expected: list[list[list[int]]]) -> list[torch.Tensor]:
        """sent[r]: the tensors for rank r; expected[r]: the shapes to receive from it. The received, in order."""
        flat = tensors[0].new_empty(sum(t.numel() for parts in sent for t in parts), dtype=dtype)
        for piece, t in zip(flat.split([t.numel() for parts in sent for t in parts]), sum(sent, []), strict=True):
            piece.view(t.shape).copy_(t)  # cast into the buffer
        counts = [[math.prod(s) for s in shapes] for shapes in expected]
        out = flat.new_empty(sum(map(sum, counts)))
        dist.all_to_all_single(out, flat, [sum(c) for c in counts], [sum(t.numel() for t in s) for s in sent], group)
        return [piece.view(s) for piece, s in zip(out.split(sum(counts, [])), sum(expected, []), strict=True)]

    by_owner = [[i for i, o in enumerate(owners) if o == r] for r in range(ranks)]
    sent = [[tensors[i] for i in jobs] for jobs in by_owner]
    pieces = iter(all_to_all(sent, [[shape(i, r) for i in mine] for r in range(ranks)]))  # rank by rank
    parts: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    for _ in range(ranks):
        for i in mine:
            parts[i].append(next(pieces))
    whole = {i: compute(torch.cat(parts.pop(i), dim=axes[i])) for i in mine}
    back = [[whole[i].narrow(axes[i], sum(rows[i][:r]), rows[i][r]) for i in mine] for r in range(ranks)]
    returned = iter(all_to_all(back, [[shape(i, me) for i in jobs] for jobs in by_owner]))
    local = {i: next(returned) for jobs in by_owner for i in jobs}
    return [local[i].to(t.dtype) for i, t in enumerate(tensors)]


def _gathered(tensor: DTensor, dims: tuple[int, ...]) -> list[Placement]:
    """`tensor`'s placements with its matrices whole: replicated along `dims` (and a partial sum reduced); split
    by expert or replicated as it was elsewhere."""
    return [Replicate() if i in dims or p.is_partial() else p for i, p in enumerate(tensor.placements)]


def _owner_coordinates(mesh: DeviceMesh, dims: tuple[int, ...], owner: int) -> list[int]:
    """The owner's coordinate on each of `dims` (owner counts over them in row-major order)."""
    coordinates = []
    for d in reversed(dims):
        owner, c = divmod(owner, mesh.size(d))
        coordinates.append(c)
    return coordinates[::-1]


def _gather_and_broadcast(
    mesh: DeviceMesh,
    dims: tuple[int, ...],
    tensors: list[torch.Tensor],
    layouts: list[DTensor],
    compute: Compute,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The local results of `tensors` laid out as `layouts`, split along `dims`, whatever the placements: every
    rank gathers each matrix along `dims` and computes those it owns (all ranks at once), then each owner
    broadcasts its results along `dims`, one dimension after the other (after the first, the ranks at the
    owner's coordinate on the next hold the result), and every rank keeps its part. The matrices travel in
    their own dtype (`dtype` is not used)."""
    owners = assign_owners([newton_schulz_cost(t.shape) for t in layouts], math.prod(mesh.size(d) for d in dims))
    here = mesh.get_coordinate()
    assert here is not None, "this rank is not in the mesh of the tensors it steps"
    coordinates = [_owner_coordinates(mesh, dims, o) for o in owners]
    split = [
        DTensor.from_local(t, mesh, like.placements, shape=like.shape, stride=like.stride())
        for t, like in zip(tensors, layouts, strict=True)
    ]
    owned, shapes = {}, []
    for i, t in enumerate(split):
        whole = t.redistribute(mesh, _gathered(t, dims)).to_local()  # every rank takes part in every gather
        shapes.append(whole.shape)
        if all(here[d] == c for d, c in zip(dims, coordinates[i], strict=True)):
            owned[i] = whole
    owned = {i: compute(whole).contiguous() for i, whole in owned.items()}
    results = []
    for i, t in enumerate(split):
        result = owned.pop(i, None)
        if result is None:
            result = torch.empty(shapes[i], dtype=t.dtype, device=tensors[i].device)
        for d, c in zip(dims, coordinates[i], strict=True):
            dist.broadcast(result, group=mesh.get_group(d), group_src=c)
        gathered = DTensor.from_local(result, mesh, _gathered(t, dims), shape=t.shape, stride=t.stride())
        results.append(gathered.redistribute(mesh, t.placements).to_local())  # this rank's part, no collective
    return results
