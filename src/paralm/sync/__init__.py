"""How data-parallel replicas agree: all-reduce, ZeRO-1, local SGD / DiLoCo, compressed gradients and
fault-tolerant replica groups, each a `SyncStrategy` with its own checkpoint state."""
