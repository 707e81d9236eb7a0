"""The private torch APIs paralm relies on, in one place: a torch upgrade that moves one fails here
(and in `tests/test_compat.py`), not somewhere deep in a training run. Each says why no public API
does the job in torch 2.13.
"""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.request
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any

import torch

# all_to_all_single with autograd: torch.distributed.nn.functional's public form is deprecated for it.
import torch.distributed._functional_collectives as funcol

# DDP semantics built on FSDP2, the only data parallelism that takes DTensor (tensor-parallel)
# parameters and pipeline stages; `DistributedDataParallel` takes neither, and it has no public path.
from torch.distributed._composable.replicate_with_fsdp import replicate

# Activation checkpointing as a module wrapper whose prefix DCP's `get_state_dict` strips, so parameter
# names stay the plain model's; the public `torch.utils.checkpoint.checkpoint` is a function, which
# would need a wrapper of our own that DCP does not know.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import ProcessGroup, _resolve_process_group
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

# Intercepting every op `init_weights` runs on a sharded parameter (to replay it at full size):
# `TorchDispatchMode` is documented but exported only from this module.
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

__all__ = [
    "SumGradients",
    "TorchDispatchMode",
    "checkpoint_wrapper",
    "cpu_flash_attention",
    "cpu_flash_attention_backward",
    "current_dispatch_mode",
    "dump_cuda_memory_snapshot",
    "end_fake_process_group",
    "flatten_mesh",
    "flight_recorder",
    "init_fake_process_group",
    "on_compile",
    "record_cuda_memory_history",
    "replicate",
    "resolve_process_group",
    "step_unless_flagged",
    "takes_skip_flag",
    "weights_only_http_transport",
]


def current_dispatch_mode() -> TorchDispatchMode | None:
    """The innermost active dispatch mode, None without one: how a test tells that no instrument (the
    byte counter is a mode) runs when none was asked for; `_get_current_dispatch_mode` is the only way."""
    return _get_current_dispatch_mode()


def cpu_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's output and its log-sum-exp per query (fp32, (batch, heads, seq)) from the CPU's fused
    kernel: ring attention merges blocks by the log-sum-exp, which `scaled_dot_product_attention` keeps to
    itself (torch's own ring attention calls these ops too, on CUDA)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def cpu_flash_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k and v for one block, given the final output and log-sum-exp of the rows."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh`'s dims merged into one named dim of the same root mesh. `DeviceMesh._flatten` is the only
    way: a new mesh over the same ranks would have another root, and FSDP2 (`replicate`) refuses to
    combine a data-parallel mesh with tensor-parallel DTensors from a different root."""
    return mesh._flatten(name)


def init_fake_process_group(rank: int, world_size: int) -> None:
    """The default process group as rank `rank` of `world_size`, with no peers: torch's fake backend
    answers every collective at once without moving data, so one process can build what any rank of a
    large job builds (the dry run). It is registered by, and its store lives in, a private testing module."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def end_fake_process_group() -> None:
    """Tear down `init_fake_process_group`'s group and forget what DTensor cached under it. DTensor caches
    sharding propagation per mesh, and meshes compare equal without regard to this process's rank: a later
    real job of the same shape (or a process forked from this one) would take the fake rank's output specs
    and place its shards at that rank's offsets. Only torch's debug module clears those caches."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    dist.destroy_process_group()
    _clear_sharding_prop_cache()


def resolve_process_group(group_name: str) -> ProcessGroup:
    """The group a functional collective names (its ops take a group name, not a group, and the byte
    counter needs its size and this rank's place); `_resolve_process_group` is the only lookup."""
    return _resolve_process_group(group_name)


def takes_skip_flag(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` reads a skip flag on the device: PyTorch's fused Adam, AdamW and SGD
    kernels (every group `fused`) take GradScaler's `found_inf` and, where it is 1, leave parameters,
    moments and step counts as they were, so the host never reads it. The attribute is undocumented (no
    public API hands an optimizer such a flag); `_step_supports_amp_scaling`, GradScaler's own test, is
    missed by an optimizer built from fused groups without `fused=True` (ZeRO-1's inner one)."""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW | torch.optim.SGD) and fused


def step_unless_flagged(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """One step of an optimizer `takes_skip_flag` accepts, a no-op on the device where `flag` (a float32
    scalar on the parameters' device) is 1: the attribute GradScaler sets for the step's duration."""
    optimizer.found_inf = flag
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def weights_only_http_transport(timeout: timedelta, host: str = "") -> Any:
    """torchft's HTTP checkpoint transport (a healthy replica group sends a recovering one its state), reading
    what arrives with torch's weights-only unpickler: torchft reads it with `weights_only=False`, so a
    peer's bytes could run code. Its `_load_from_address` is the one place that reads, and torch's
    `_streaming_load` the only reader of the streaming format its sender writes. With `host`, it listens on
    that address alone (torchft binds every interface and has no parameter for it) and says so to peers."""
    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing import http_transport
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

        def address(self) -> str:
            if not host:
                return super().address()
            return f"http://{_url_host(host)}:{self._server.socket.getsockname()[1]}/checkpoint/"

    if not host:
        return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)

    class BoundServer(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def __init__(self, server_address: tuple[str, int], handler: Any) -> None:
            super().__init__((host, 0), handler)

    unbound = http_transport._IPv6HTTPServer  # the server class HTTPTransport builds in its constructor
    http_transport._IPv6HTTPServer = BoundServer
    try:
        return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)
    finally:
        http_transport._IPv6HTTPServer = unbound


@contextlib.contextmanager
def torchft_manager_bound_to(host: str) -> Iterator[None]:
    """A torchft `Manager` built inside listens on `host` alone (its server binds every interface, `[::]`,
    and takes no address); empty: as torchft does."""
    if not host:
        yield
        return
    from torchft import manager

    unbound = manager.ManagerServer

    def bound(**kwargs: Any) -> Any:
        port = kwargs["bind"].rsplit(":", 1)[1]
        return unbound(**{**kwargs, "bind": f"{_url_host(host)}:{port}"})

    manager.ManagerServer = bound
    try:
        yield
    finally:
        manager.ManagerServer = unbound


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def ddp_ignore(model: torch.nn.Module, names: list[str]) -> None:
    """DDP leaves these parameters alone (expert parallelism syncs them itself); a static method of DDP's."""
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def all_to_all_autograd(
    tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """`all_to_all_single` with a backward (the reverse exchange); torch's public autograd form is deprecated."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(tensor, output_splits, input_splits, group))


def flight_recorder() -> dict[str, Any]:
    """This rank's collectives as torch's flight recorder holds them (each process group's enqueued and
    completed sequence numbers, and the last entries: op, sizes, when created). In torch 2.13 it records
    gloo as well as NCCL, the collectives DDP issues from C++ included; only `_dump_fr_trace_json` reads
    it from a live process (the public `torch.distributed.flight_recorder` analyses dumps)."""
    from torch._C._distributed_c10d import _dump_fr_trace_json

    return json.loads(_dump_fr_trace_json(True, False))


def on_compile(start: Callable[[], None], end: Callable[[], None]) -> Callable[[], None]:
    """Have torch call `start` when it begins compiling (dynamo tracing a frame, a backward compiled when first
    run, CUDA graphs recorded) and `end` when it is done, nested compilations once; returns the function that
    removes them. Dynamo's compile callbacks are torch's only signal of it (`torch.compiler` exports none);
    `torch._dynamo.reset()` drops them."""
    from torch._dynamo.callback import callback_handler

    def started(_: object) -> None:
        start()

    def ended(_: object) -> None:
        end()

    callback_handler.register_start_callback(started)
    callback_handler.register_end_callback(ended)

    def remove() -> None:
        if started in callback_handler.start_callbacks:
            callback_handler.remove_start_callback(started)
        if ended in callback_handler.end_callbacks:
            callback_handler.remove_end_callback(ended)

    return remove


def record_cuda_memory_history(on: bool) -> None:
    """Start (or stop) recording every CUDA allocation with its stack; no public API in torch 2.13."""
    torch.cuda.memory._record_memory_history(max_entries=100_000 if on else 0, enabled="all" if on else None)


def dump_cuda_memory_snapshot(path: str) -> None:
    """The recorded history as a pickle for https://pytorch.org/memory_viz; no public API in torch 2.13."""
    torch.cuda.memory._dump_snapshot(path)


def capture_scalar_outputs() -> None:
    """Let `torch.compile` trace a tensor read back as numbers (`tolist`, sizes that depend on the data)
    into the graph rather than stop there: the experts' split sizes where the grouped kernel does not run,
    and expert parallelism's all-to-all splits. Dynamo's config module is the only switch for it."""
    torch._dynamo.config.capture_scalar_outputs = True


def compile_counters() -> tuple[int, int]:
    """(graphs compiled, graph breaks met) by `torch.compile` in this process so far. Dynamo's counters are
    its only record of either (torch's own tests read them); each break is counted once, when compiled."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


class SumGradients(ParallelStyle):
    """A tensor-parallel style for an identity module: its output's gradient is summed over the group (Megatron's
    "f" operator), for a replicated activation each rank reads for its own heads only. A custom style overrides
    `ParallelStyle._apply`, the one extension point torch gives (no public name); the work is public DTensor
    calls: `from_local` as replicated, `to_local` with a partial gradient, which autograd sums."""

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        def forward_hook(_: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            replicated = DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)
            return replicated.to_local(grad_placements=[Partial()])

        module.register_forward_hook(forward_hook)
        return module
