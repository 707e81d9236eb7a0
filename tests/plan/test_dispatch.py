"""What calibrate measures per kernel: the plain block, and the tensor-parallel one under the byte counter."""

import copy

import pytest
import torch
from paralm.model import Block
from torch.distributed.tensor import DTensor, Shard

from paralm.compat import current_dispatch_mode
from paralm.plan import dispatch


def test_the_tensor_parallel_latency_is_what_the_parallel_block_under_the_counter_adds(monkeypatch) -> None:
    """On a clock that each backward moves by 3 units inside the counter's mode on DTensor parameters and
    by 1 otherwise, the kernel latency is 1 and the tensor-parallel latency 2 (per counted kernel):
    the parallel block runs on DTensors, inside the counter; the plain one on neither."""
    now = [0.0]
    calls = {"parallel": 0, "plain": 0}
    forward = Block.forward

    def timed_forward(self, x):
        parallel = isinstance(self.attn.wq.weight, DTensor)
        assert parallel == (current_dispatch_mode() is not None), "the counter is on for the parallel block only"
        calls["parallel" if parallel else "plain"] += 1
        out = forward(self, x)
        now[0] += 3.0 if parallel else 1.0
        return out

    monkeypatch.setattr(Block, "forward", timed_forward)
    monkeypatch.setattr(dispatch.time, "perf_counter", lambda: now[0])
    measured = dispatch.kernel_latencies(torch.device("cpu"), lambda: None, rounds=3)
    assert measured["kernel_latency"] == pytest.approx(1.0 / dispatch.BLOCK_STEP_KERNELS)
    assert measured["tensor_parallel_latency"] == pytest.approx(2.0 / dispatch.BLOCK_STEP_KERNELS)
    assert calls["parallel"] >= 3 and calls["plain"] >= 3


def test_the_parallel_block_is_paralms_plan_and_computes_what_the_block_does() -> None:
    """Column-wise q, k, v and MLP up projection, row-wise output projections (over a one-rank mesh),
    and the same forward and input gradient as the plain block with the same weights."""
    plain = Block(dispatch.TINY_BLOCK)
    x = torch.randn(2, dispatch.TINY_BLOCK.block_size, dispatch.TINY_BLOCK.d_model, requires_grad=True)
    plain(x).sum().backward()
    expected, x.grad = x.grad.clone(), None
    with dispatch.tensor_parallel(copy.deepcopy(plain)) as parallel:
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc"):
            assert parallel.get_submodule(name).weight.placements == (Shard(0),)
        for name in ("attn.wo", "mlp.proj"):
            assert parallel.get_submodule(name).weight.placements == (Shard(1),)
        assert not isinstance(parallel.get_submodule("ln_1").weight, DTensor)  # no SP: LayerNorms untouched
        out = parallel(x)
        assert not isinstance(out, DTensor)
        torch.testing.assert_close(out, plain(x))
        out.sum().backward()
        torch.testing.assert_close(x.grad, expected)
