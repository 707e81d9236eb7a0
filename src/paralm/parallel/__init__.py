"""How the model is spread over ranks: the runtime (process group and mesh), the strategies that shard or
wrap the model (TP/SP, pipeline, context, expert, FSDP, DDP), and `parallelize`, the one root composing them."""
