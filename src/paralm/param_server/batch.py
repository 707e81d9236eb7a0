"""How many sequences one parameter-server update takes, and how the workers divide them.

Synchronous: an update is the global batch, divided over the workers as all-reduce data parallelism
divides it over its ranks (`train.global_batch_size`, when set, decides the accumulation), and a
resumed run keeps its checkpoint's global batch as the trainer does (`paralm.train.checkpoint.resume_batch`),
whichever mode wrote the checkpoint. Asynchronous: an update is one worker's own batch,
`train.grad_accum` x `train.micro_batch_size`.
"""

from __future__ import annotations

from paralm.config.degrees import resolve_grad_accum
from paralm.config.schema import Config
from paralm.data.sampler import BatchLayout
from paralm.train.checkpoint.resume_batch import keep_global_batch


def update_layout(config: Config, workers: int, saved: object) -> tuple[BatchLayout, str | None]:
    """The layout of one update given the checkpoint's global batch `saved` (None: a fresh run, or a
    checkpoint that records none), and the line to tell the user when a resume changes it."""
    t = config.train
    if config.sync.ps_async:
        return BatchLayout(1, t.grad_accum, t.micro_batch_size), None
    layout = BatchLayout(workers, resolve_grad_accum(config, workers), t.micro_batch_size)
    return keep_global_batch(layout, saved, t.global_batch_size)
