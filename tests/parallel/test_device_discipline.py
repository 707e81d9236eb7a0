"""Every tensor handed to torch.distributed lives on its group's device: checked on CPU with the meta device.

Each rank's compute device is `meta` (as a GPU would be `cuda`), and torch.distributed's collectives
and point-to-point calls are wrapped: the device groups (the default group and the mesh's, NCCL on GPUs)
must receive tensors of the devices the backend string given to `init_process_group` names (a bare
name such as "nccl": the compute device only; "meta:gloo,cpu:gloo": meta and CPU), meta ones skipping
the actual communication, and the groups made for host metadata (`new_group(backend="gloo")`) must
receive CPU tensors, which are really sent. Anything else is recorded as a violation, which is what
NCCL would reject on a GPU. `item()` / `tolist()` on meta return zeros, so the loops run to the end.

Covered: the trainer's step (local SGD and DiLoCo: DDP and FSDP cannot be built on meta, their
communication is torch's), evaluation, the stop-signal flag, comm accounting, checkpoint state
collection (DCP cannot write meta tensors: the state is collected, not written), the parameter server
(synchronous and asynchronous, servers on the device and on the CPU) and the compression hooks (called
on a meta bucket). Not covered: collectives torch makes inside DDP's reducer, FSDP, DTensor (clipping's
norm of CPU-offloaded shards among them: the default group's "cuda:nccl,cpu:gloo" serves it) and DCP.
"""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from tests.helpers import tiny_config
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.slow

# name -> position of the tensor (or list of tensors) argument(s) to check
CHECKED = {
    "all_reduce": (0,),
    "all_gather": (0, 1),
    "all_gather_into_tensor": (0, 1),
    "reduce_scatter_tensor": (0, 1),
    "broadcast": (0,),
    "reduce": (0,),
    "send": (0,),
    "recv": (0,),
    "isend": (0,),
    "irecv": (0,),
}


class _Done:
    """The work of a skipped asynchronous call: done, its future holding the tensors."""

    def __init__(self, value: object) -> None:
        self.value = value

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self.value)
        return future


class _MetaReads(TorchFunctionMode):
    """`item()`, `tolist()`, number conversions and copies to the host of meta tensors read zeros."""

    READS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__)
    COPIES = (torch.Tensor.to, torch.Tensor.cpu)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.READS and args[0].is_meta:
            return func(torch.zeros(args[0].shape, dtype=args[0].dtype))
        if func in self.COPIES and args[0].is_meta:
            if func is torch.Tensor.to and _stays_meta(args, kwargs):
                return func(*args, **kwargs)
            return func(torch.zeros_like(args[0], device="cpu"), *args[1:], **kwargs)
        return func(*args, **kwargs)


def _stays_meta(args: tuple, kwargs: dict) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` leaves a meta tensor on meta (a dtype change, or `.to("meta")`)."""
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), "meta"))
    return torch.device(target).type == "meta"


class Discipline:
    """Installs the checks in this process; `violations` lists what a GPU would reject."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.host_groups: set[dist.ProcessGroup] = set()
        self.calls: dict[str, int] = {}
        self.device_group_devices = {"meta"}  # what the default group's backend serves: set at its creation

    @contextlib.contextmanager
    def active(self):
        patches = [
            mock.patch("paralm.parallel.runtime.select_device", lambda local_rank: torch.device("meta")),
            # meta stands for cuda, gloo (which skips nothing: meta tensors never reach it) for NCCL
            mock.patch.dict("paralm.parallel.runtime.DEVICE_BACKENDS", {"meta": "gloo"}),
        ]
        new_group = dist.new_group
        init_process_group = dist.init_process_group

        def recording_init_process_group(backend=None, *args, **kwargs):
            if backend and ":" in backend:  # "meta:gloo,cpu:gloo": one backend per device type
                self.device_group_devices = {pair.split(":")[0] for pair in backend.split(",")}
            return init_process_group(backend, *args, **kwargs)

        def recording_new_group(*args, **kwargs):
            group = new_group(*args, **kwargs)
            if kwargs.get("backend") == "gloo":
                self.host_groups.add(group)
            return group

        patches.append(mock.patch.object(dist, "new_group", recording_new_group))
        patches.append(mock.patch.object(dist, "init_process_group", recording_init_process_group))
        for name, positions in CHECKED.items():
            patches.append(mock.patch.object(dist, name, self._checked(name, getattr(dist, name), positions)))
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            stack.enter_context(_MetaReads())
            yield self

    def _checked(self, name, call, positions):
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            host = group is not None and group in self.host_groups
            tensors = []
            for i in positions:
                value = args[i] if i < len(args) else None
                tensors += value if isinstance(value, list) else [value] if value is not None else []
            want = {"cpu"} if host else self.device_group_devices
            for t in tensors:
                if t.device.type not in want:
                    where = _caller()
                    self.violations.append(
                        f"{name} on {'gloo host' if host else 'device'} group: {t.device} at {where}"
                    )
            key = f"{name}/{'host' if host else 'device'}"
            self.calls[key] = self.calls.get(key, 0) + 1
            if tensors and all(t.is_meta for t in tensors):  # nothing to send
                if name in ("recv", "irecv") and not kwargs.get("async_op"):
                    src = args[1] if len(args) > 1 else kwargs.get("src")
                    return src if name == "recv" else _Done(None)
                return _Done(args[0] if name == "all_reduce" else [args[0]]) if kwargs.get("async_op") else None
            return call(*args, **kwargs)

        return wrapper


def _caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/paralm/" in f.filename and "/tests/" not in f.filename]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:])) or "?"


def _collect_state(*args, **kwargs):
    """Stands in for a checkpoint save: collects the state (its collectives are checked), writes nothing."""
    state = next(a for a in (*args, *kwargs.values()) if hasattr(a, "state_dict") and hasattr(a, "load_state_dict"))
    state.state_dict()
    return Path("collected")


def _train(config):
    from paralm.job import train

    with (
        Discipline().active() as discipline,
        mock.patch("paralm.train.checkpoint.saver.Checkpointer.save", lambda self, *a, **k: _collect_state(*a, **k)),
        mock.patch("paralm.param_server.shard.save_checkpoint", _collect_state),
    ):
        train(config)
    return discipline.violations, discipline.calls


def _hooks(config):
    """The compression hooks on a meta bucket of a 2-rank job."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from paralm.parallel.runtime import init_runtime, shutdown
    from paralm.sync import compression
    from paralm.sync.bucket_state import BucketState

    with Discipline().active() as discipline:
        runtime = init_runtime(config.parallel, config.sync)
        state = compression.HookState(None, topk_ratio=0.25)
        one_parameter = lambda bucket: ([("weight", 0, 64)], 64)  # noqa: E731 - the bucket holds one 64-entry gradient
        state.buckets = BucketState({"residual": (state.residuals, one_parameter)})
        hooks = {  # each with its state: the default group, or top-k's
            "fp16": (None, default_hooks.fp16_compress_hook),
            "bf16": (None, compression.bf16_cast_hook),
            "topk": (state, compression.topk_hook),
        }
        for hook_state, hook in hooks.values():
            for _ in range(2):  # the second time with top-k's residual
                hook(hook_state, _Bucket(torch.zeros(64, device=runtime.device))).wait()
        shutdown(runtime)
    return discipline.violations, discipline.calls


class _Bucket:
    """What the hooks read of a `dist.GradBucket`."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _assert_disciplined(results):
    for violations, calls in results:
        assert not violations, "\n".join(sorted(set(violations)))
        assert any(k.endswith("/device") for k in calls), calls  # the device group was used: the check ran


@pytest.mark.parametrize(
    "sync",
    [
        {"mode": "local_sgd", "local_steps": 2},
        {"mode": "diloco", "local_steps": 2},
    ],
    ids=["local_sgd", "diloco"],
)
def test_trainer_step_evaluation_checkpoint_and_accounting(tmp_path, sync):
    config = tiny_config(tmp_path / "run", train={"steps": 4, "eval_every": 2}, sync=sync, checkpoint={"every": 2})
    _assert_disciplined(run_ranks(_train, 2, tmp_path, config))


@pytest.mark.parametrize(
    "sync",
    [
        {"ps_servers": 1},
        {"ps_servers": 2, "ps_async": True},
        {"ps_servers": 2, "ps_server_device": "cpu"},
        {"ps_servers": 1, "ps_async": True, "ps_server_device": "cpu"},
    ],
    ids=["sync", "async", "sync_cpu_servers", "async_cpu_servers"],
)
def test_parameter_server(tmp_path, sync):
    config = tiny_config(
        tmp_path / "run",
        train={"steps": 3, "eval_every": 2, "grad_clip": 1.0},
        sync={"mode": "parameter_server", **sync},
        log={"comm_bytes": True},  # its accounting too; without it a CPU server uses no device group at all
    )
    results = run_ranks(_train, 3, tmp_path, config)
    _assert_disciplined(results)
    assert any(k.startswith("recv/host") for _, calls in results for k in calls)  # headers went through gloo


def test_compression_hooks(tmp_path):
    config = tiny_config(tmp_path / "run")
    _assert_disciplined(run_ranks(_hooks, 2, tmp_path, config))
