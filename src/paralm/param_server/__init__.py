"""Parameter server: ranks 0..k-1 (`sync.ps_servers` = k) hold the parameters and optimizer state,
sharded (`shard`); the other ranks are workers (`worker`) that pull parameters, compute gradients on
the step engine the trainer also runs (`paralm.train.engine`) and push them.

It runs on `torch.distributed` point-to-point messages (`protocol`), launched by torchrun like every
other mode; `run.run_parameter_server` is every rank's entry point. The servers run their own loop
(`server`, with the lead's metrics in `log`): the optimizer steps there, not on the workers.
Evaluation runs on the workers (at `train.eval_every` and the end when synchronous, at the end when
not: asynchronous workers hold different parameters until then).

A rank that dies closes its connections, so its peers' sends and receives fail at once and torchrun
stops the job; the launcher names the rank that failed first.
"""
