"""How many bytes one dispatched collective or point-to-point op moves, per rank.

Conventions, per rank, for a group of P ranks and n bytes handed over by this rank:
- all-reduce: a ring, 2(P-1)/P x n sent and as much received;
- all-gather (n = this rank's input): (P-1) x n sent and received;
- reduce-scatter (n = the full input) and all-to-all: (P-1)/P x n sent and received;
- broadcast: a star from the root, which sends (P-1) x n; every other rank receives n;
- reduce and gather: every non-root sends n, the root receives (P-1) x n; scatter the reverse;
- send and receive: n at each end.
An op of the collective namespaces that has no convention here fails loudly: a torch upgrade that
adds one must add its convention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paralm.compat import resolve_process_group

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
IGNORED = {"barrier", "monitored_barrier_", "wait_tensor", "_wrap_tensor_autograd", "check_for_nan"}


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(tensor_bytes(v) for v in value)


def _ring(fraction: Callable[[int], float]) -> Callable[[int, int, bool], tuple[float, float]]:
    def volume(n: int, size: int, root: bool) -> tuple[float, float]:
        return fraction(size) * n, fraction(size) * n

    return volume


def _rooted(n: int, size: int, root: bool) -> tuple[float, float]:  # reduce, gather: all send to the root
    return (0, (size - 1) * n) if root else (n, 0)


def _from_root(n: int, size: int, root: bool) -> tuple[float, float]:  # broadcast, scatter
    return ((size - 1) * n, 0) if root else (0, n)


# op name -> (the argument whose size is n, how n becomes (sent, received) per rank, the root argument)
RULES: dict[str, tuple[str, Callable[[int, int, bool], tuple[float, float]], str | None]] = {}
for _names, _arg, _volume, _root in [
    (("allreduce_", "allreduce_coalesced_"), "tensors", _ring(lambda p: 2 * (p - 1) / p), None),
    (("all_reduce", "all_reduce_"), "input", _ring(lambda p: 2 * (p - 1) / p), None),
    (("all_reduce_coalesced", "all_reduce_coalesced_"), "inputs", _ring(lambda p: 2 * (p - 1) / p), None),
    (("allgather_",), "input_tensors", _ring(lambda p: p - 1), None),
    (("_allgather_base_",), "input_tensor", _ring(lambda p: p - 1), None),
    (("allgather_coalesced_",), "input_list", _ring(lambda p: p - 1), None),
    (("allgather_into_tensor_coalesced_", "all_gather_into_tensor_coalesced"), "inputs", _ring(lambda p: p - 1), None),
    (("all_gather_into_tensor", "all_gather_into_tensor_out"), "input", _ring(lambda p: p - 1), None),
    (("reduce_scatter_",), "input_tensors", _ring(lambda p: (p - 1) / p), None),
    (("_reduce_scatter_base_",), "input_tensor", _ring(lambda p: (p - 1) / p), None),
    (
        ("reduce_scatter_tensor_coalesced_", "reduce_scatter_tensor_coalesced"),
        "inputs",
        _ring(lambda p: (p - 1) / p),
        None,
    ),
    (("reduce_scatter_tensor", "reduce_scatter_tensor_out"), "input", _ring(lambda p: (p - 1) / p), None),
    (("alltoall_",), "input_tensors", _ring(lambda p: (p - 1) / p), None),
    (("alltoall_base_", "all_to_all_single"), "input", _ring(lambda p: (p - 1) / p), None),
    (("broadcast_",), "tensors", _from_root, "root_rank"),
    (("broadcast",), "input", _from_root, "src"),
    (("reduce_",), "tensors", _rooted, "root_rank"),
    (("gather_",), "input_tensors", _rooted, "root_rank"),
    (("scatter_",), "output_tensors", _from_root, "root_rank"),
    (("send",), "tensors", lambda n, size, root: (n, 0), None),
    (("isend",), "tensor", lambda n, size, root: (n, 0), None),
    (("recv_", "recv_any_source_"), "tensors", lambda n, size, root: (0, n), None),
    (("irecv",), "tensor", lambda n, size, root: (0, n), None),
]:
    for _name in _names:
        RULES[_name] = (_arg, _volume, _root)


def _group_of(bound: dict[str, Any]) -> Any:
    if "process_group" in bound:  # the dispatcher hands the group over boxed (a script object)
        return dist.ProcessGroup.unbox(bound["process_group"])
    return resolve_process_group(bound["group_name"])


def wire_bytes(func: Any, args: tuple, kwargs: dict) -> tuple[float, float] | None:
    """(sent, received) by this rank for one dispatched op; None when it is not communication."""
    if func.namespace not in NAMESPACES:  # higher-order operators have no schema: checked first
        return None
    name = func._schema.name.split("::")[-1]
    if name in IGNORED:
        return None
    bound = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)} | kwargs
    if name == "batch_p2p_ops":
        sizes = [tensor_bytes(t) for t in bound["tensors"]]
        sent = sum(n for op, n in zip(bound["op_list"], sizes, strict=True) if op == "isend")
        return sent, sum(sizes) - sent
    if name not in RULES:
        raise NotImplementedError(f"paralm.parallel.wire_volume: no byte convention for {func}")
    arg, volume, root_arg = RULES[name]
    group = _group_of(bound)
    is_root = root_arg is not None and bound[root_arg] == group.rank()
    return volume(tensor_bytes(bound[arg]), group.size(), is_root)
