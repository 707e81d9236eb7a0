"""The tensor-parallel reference runs paralm's plan over pairs of workers, under the byte counter."""

import torch.distributed as dist

from paralm.parallel.comm_stats import CommStats
from paralm.plan import tp_reference
from tests.multiprocess import run_ranks


def _reference(rounds: int) -> tuple[float, list[list[int]], int]:
    """This rank's seconds, the ranks of each mesh its blocks were parallelized over, and the bytes the
    counter saw it send."""
    meshes, counters = [], []
    parallelize = tp_reference.parallelize_module

    def recording_parallelize(module, mesh, plan):
        meshes.append(mesh.mesh.tolist())
        return parallelize(module, mesh, plan)

    class RecordingStats(CommStats):
        def __init__(self) -> None:
            super().__init__()
            counters.append(self)

    tp_reference.parallelize_module = recording_parallelize
    tp_reference.CommStats = RecordingStats
    dist.init_process_group("gloo")
    try:
        seconds = tp_reference.reference_seconds(rounds)
    finally:
        dist.destroy_process_group()
    return seconds, meshes, counters[0].sent


def test_the_reference_runs_on_pairs_of_workers_and_communicates(tmp_path) -> None:
    """Four workers measure as two pairs: each rank's blocks are parallelized over its own pair, and the
    forward and backward all-reduces move activations (the counter sees them)."""
    results = run_ranks(_reference, 4, tmp_path, 2)
    for rank, (seconds, meshes, sent) in enumerate(results):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert meshes == [pair] * tp_reference.REFERENCE.n_layer
        assert seconds > 0 and sent > 0
