"""Every private torch API paralm uses still exists where `paralm.compat` takes it from, and works."""

from datetime import timedelta

import torch

from paralm import compat


def test_the_private_apis_import():
    assert callable(compat.checkpoint_wrapper) and callable(compat.replicate) and callable(compat.flatten_mesh)
    assert issubclass(compat.TorchDispatchMode, object)


def test_checkpoint_wrapper_keeps_the_module_working():
    block = torch.nn.Linear(3, 3)
    wrapped = compat.checkpoint_wrapper(block)
    x = torch.ones(2, 3)
    assert torch.equal(wrapped(x), block(x))


def test_a_dispatch_mode_sees_the_ops():
    seen = []

    class Record(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2).add_(1)
    assert seen


def test_a_functional_collectives_group_resolves_by_name(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        group = compat.resolve_process_group(dist.group.WORLD.group_name)
        assert group.size() == 1 and group.rank() == 0
    finally:
        dist.destroy_process_group()


def test_a_fused_optimizer_skips_a_flagged_step_on_the_device():
    param = torch.nn.Parameter(torch.ones(3))
    fused = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1, fused=True)
    assert compat.takes_skip_flag(fused)
    assert not compat.takes_skip_flag(torch.optim.AdamW([param], lr=0.1, foreach=True))
    param.grad = torch.ones(3)
    fused.step()
    weights, moments = param.detach().clone(), {k: v.clone() for k, v in fused.state[param].items()}
    param.grad = torch.full((3,), float("nan"))
    compat.step_unless_flagged(fused, torch.ones(()))  # skipped: weights, moments and step count as they were
    assert torch.equal(param, weights) and all(torch.equal(fused.state[param][k], v) for k, v in moments.items())
    param.grad = torch.ones(3)
    compat.step_unless_flagged(fused, torch.zeros(()))
    assert not torch.equal(param, weights) and fused.state[param]["step"].item() == 2


def test_cpu_flash_attention_returns_sdpa_and_its_log_sum_exp_and_gradients():
    q, k, v = (torch.randn(1, 2, 6, 4, requires_grad=True) for _ in range(3))
    out, lse = compat.cpu_flash_attention(q, k, v, causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    scores = (q @ k.transpose(-2, -1)) / 2 + torch.full((6, 6), float("-inf")).triu(1)
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    grad = torch.randn_like(out)
    expected.backward(grad)
    grads = compat.cpu_flash_attention_backward(grad, q, k, v, out, lse, causal=True)
    for got, tensor in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(got, tensor.grad)


def test_torchft_servers_listen_on_the_address_they_are_given():
    """torchft's manager and HTTP checkpoint servers bind every interface and take no address: bound to one
    (`sync.ft_bind`, loopback under `paralm train --replicas`), each listens there alone, and its peers are
    told that address; without one, as torchft does (the control: every interface)."""
    import psutil
    import torch.distributed as dist
    from torchft import manager
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with compat.torchft_manager_bound_to("127.0.0.1"):
        server = manager.ManagerServer(
            replica_id="bound",
            lighthouse_addr="http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1],
            hostname="127.0.0.1",
            bind="[::]:0",
            store_addr=f"127.0.0.1:{store.port}",
            world_size=1,
            heartbeat_interval=timedelta(seconds=1),
            connect_timeout=timedelta(seconds=5),
            quorum_retries=0,
        )
    bound = compat.weights_only_http_transport(timedelta(seconds=5), "127.0.0.1")
    everywhere = compat.weights_only_http_transport(timedelta(seconds=5))
    try:
        listening = {c.laddr.port: c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}
        manager_port = int(server.address().rsplit(":", 1)[1])
        assert server.address().startswith("http://127.0.0.1:") and listening[manager_port] == "127.0.0.1"
        assert bound.address().startswith("http://127.0.0.1:")
        assert listening[bound._server.socket.getsockname()[1]] == "127.0.0.1"
        assert listening[everywhere._server.socket.getsockname()[1]] in ("::", "0.0.0.0")
    finally:
        for transport in (bound, everywhere):
            transport.shutdown()
        server.shutdown()
        lighthouse.shutdown()


def test_torch_says_when_it_compiles_until_the_callbacks_are_removed():
    seen = []
    remove = compat.on_compile(lambda: seen.append("start"), lambda: seen.append("end"))
    try:
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    finally:
        remove()
    torch.compile(lambda x: x * 3, backend="eager")(torch.ones(2))
    assert seen == ["start", "end"]
