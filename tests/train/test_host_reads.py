"""A dense step reads nothing back to the host; only a logging step does (issue 52's GPU path, counted on a CPU).

The whole loop of GPT-2 and Llama runs with fused AdamW, gradient clipping, a skipped bad step and metrics,
under both loss heads that a GPU run uses (plain logits and the chunked head). `torch.Tensor`'s read-backs are
counted across `Trainer.fit`, and each one is placed inside a step or between two: inside a step there must be
none, between steps only where the loop logs (after the first step, every `log.every` steps and the last), with
the read-back cadence of a GPU run (a CPU run reads back every step, where it costs nothing). Not counted: the
stop-signal flag each step agrees on, a host tensor all-reduced on the gloo group (no device round trip).
"""

import pytest

from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.interrupt import StopSignals
from paralm.train.trainer import Trainer
from tests.helpers import host_reads, read_metrics, tiny_config
from tests.train.test_skipped_steps import _poison_loss

STEPS, EVERY = 7, 3


def _reads_by_place(config, monkeypatch) -> tuple[list[list[str]], dict[int, list[str]]]:
    """The host reads of each step, and those made after each step (keyed by the steps done then)."""
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime)
    trainer.metrics.every = config.log.every  # as on a GPU
    train_step, agreed, inside, after = trainer.train_step, StopSignals.agreed, [], {}

    with host_reads() as seen:

        def host_flag(self: StopSignals, runtime) -> int:
            before = len(seen)
            signum = agreed(self, runtime)
            del seen[before:]
            return signum

        def counted_step() -> bool:
            after.setdefault(trainer.step, []).extend(seen)
            seen.clear()
            committed = train_step()
            inside.append(list(seen))
            seen.clear()
            return committed

        trainer.train_step = counted_step
        monkeypatch.setattr(StopSignals, "agreed", host_flag)
        trainer.fit()
        after.setdefault(trainer.step, []).extend(seen)
    shutdown(runtime)
    return inside, after


@pytest.mark.parametrize("loss_impl", ["plain", "chunked"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_only_logging_steps_read_back_to_the_host(tmp_path, monkeypatch, family, loss_impl):
    _poison_loss(monkeypatch, {2}, rank=0)  # the third step is skipped on the device
    config = tiny_config(
        tmp_path / "r",
        model={"family": family},
        train={"steps": STEPS, "grad_clip": 1.0, "loss_impl": loss_impl},
        log={"every": EVERY},
        checkpoint={"every": 0},
    )
    inside, after = _reads_by_place(config, monkeypatch)
    logged = {1, STEPS} | {s for s in range(1, STEPS + 1) if s % EVERY == 0}
    assert inside == [[]] * STEPS
    assert {s for s, reads in after.items() if reads and s > 0} <= logged
    assert all(after.get(s) for s in logged)  # the harness sees the reads a logging step does make
    rows = read_metrics(config.run.dir)
    assert [r.get("skipped") for r in rows] == [None, None, True, None, None, None, None]
