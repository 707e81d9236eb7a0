"""`paralm verify`: train every layout that fits on N ranks and compare it with one process.

Exact layouts must match one process's losses, gradient norms and final weights within
`EXACT_TOLERANCE`. Approximate methods are held to the property they do guarantee, each with its own
measured check (see `APPROXIMATE`). The test suite calls `verify` on a reduced matrix, so CI and users
run one definition.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from paralm.config.dims import ParallelDims
from paralm.config.load import load_config
from paralm.config.rules import layout_problem
from paralm.errors import UserError
from paralm.evidence.matrix import (
    EXACT_TOLERANCE,
    GLOBAL_BATCH,
    MODELS,
    CheckedLayout,
    exact_layouts,
    name_matches,
    reference_layout,
)
from paralm.evidence.runner import Run, final_weights, max_gap, step_rows, train_run, weight_gap
from paralm.models.config import ModelConfig
from paralm.models.moe_config import moe_options
from paralm.models.registry import model_shape
from paralm.plan.context import context_parallel_bytes
from paralm.plan.layout import Layout as PlanLayout
from paralm.plan.layout import Workload


@dataclass
class Trained:
    rows: list[dict]
    weights: dict

    def series(self, key: str) -> list[float | None]:
        return [row.get(key) for row in self.rows]


@dataclass
class Verdict:
    family: str
    layout: str
    ranks: int
    loss_gap: float | None
    grad_norm_gap: float | None
    weight_gap: float | None
    tolerance: str
    holds: bool
    guarantee: str = "equals one process"
    measured: str = ""


class Refused(Exception):
    """A layout paralm's config rules refuse for a family's model: the layout's name and their one line."""


class Matrix:
    """Trains one family's model in layouts into a work folder, each once, and the one-process
    reference they are held to."""

    def __init__(self, work: Path, echo: Callable[[str], None], family: str = "gpt2") -> None:
        self.work, self.echo, self._done = work / family, echo, {}
        self.family, self.model = family, MODELS[family]

    def refusal(self, layout: CheckedLayout) -> str | None:
        """Why paralm would not train this layout of the family's model (its rules' line), or None."""
        try:
            config = load_config(None, layout.args(self.model))
        except UserError as error:
            return str(error)
        return layout_problem(config, layout.ranks, layout.servers)

    def train(self, layout: CheckedLayout) -> Trained:
        if layout.name not in self._done:
            reason = self.refusal(layout)
            if reason:
                raise Refused(f"{layout.name}: {reason}")
            started = time.perf_counter()
            run = train_run(Run(layout.name, layout.ranks, layout.args(self.model), self.work / _slug(layout.name)))
            self._done[layout.name] = Trained(step_rows(run.dir), final_weights(run.dir))
            seconds = time.perf_counter() - started
            self.echo(f"  trained {self.family} {layout.name} on {layout.ranks} rank(s) in {seconds:.0f} s")
        return self._done[layout.name]

    def reference(self) -> Trained:
        return self.train(reference_layout())


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def check_exact(matrix: Matrix, layout: CheckedLayout) -> Verdict:
    ref, run = matrix.reference(), matrix.train(layout)
    loss, weights = max_gap(ref.series("loss"), run.series("loss")), weight_gap(ref.weights, run.weights)
    norm = None if layout.grad_norm_unchecked else max_gap(ref.series("grad_norm"), run.series("grad_norm"))
    holds = max(loss, weights, norm or 0.0) <= EXACT_TOLERANCE
    guarantee = "equals one process" + (f" (grad norm not compared: {layout.grad_norm_unchecked})" * bool(norm is None))
    return Verdict(
        matrix.family, layout.name, layout.ranks, loss, norm, weights, f"{EXACT_TOLERANCE:.0e}", holds, guarantee
    )


CP_SETTINGS = ("parallel.cp", "parallel.cp_method")


def check_context_parallel(matrix: Matrix, layout: CheckedLayout) -> Verdict:
    """Exact, and context-parallel: each step sends, beyond the same layout without cp (whose gradient traffic
    it shares), the attention traffic the planner prices for its cp ranks (ring or all-to-all). Replicated
    compute on whole sequences would match one process too, and send nothing more."""
    verdict = check_exact(matrix, layout)
    without = {k: v for k, v in layout.settings.items() if k not in CP_SETTINGS}
    base = next((other for other in exact_layouts(layout.ranks) if other.settings == without), None)
    base = base or CheckedLayout(f"{layout.name}-without-cp", layout.ranks, without)
    sent, shared = matrix.train(layout).series("comm_bytes"), matrix.train(base).series("comm_bytes")
    extra = sorted({a - b for a, b in zip(sent, shared, strict=True)})
    planned = planned_cp_bytes(layout, matrix.model)
    verdict.measured = (
        f"bytes/step beyond {base.name}: {', '.join(map(str, extra))}, the planner's cp bytes {planned:.0f}"
    )
    verdict.holds = verdict.holds and all(abs(e - planned) <= 0.01 * planned for e in extra)
    return verdict


def planned_cp_bytes(layout: CheckedLayout, model: ModelConfig) -> float:
    """The planner's context-parallel bytes of one step, summed over the ranks (as metrics sum comm_bytes)."""
    config = load_config(None, layout.args(model))
    dims = ParallelDims.from_config(config.parallel, config.sync, layout.ranks)
    work = Workload.from_config(config, GLOBAL_BATCH, "fp32-master")
    return layout.ranks * model.n_layer * context_parallel_bytes(PlanLayout.of_config(config, dims), work)


def _within(matrix: Matrix, layout: CheckedLayout, against: Trained | None, bound: float, guarantee: str) -> Verdict:
    """A layout whose losses (and weights) stay within `bound` of `against` (default: one process)."""
    against = against or matrix.reference()
    run = matrix.train(layout)
    loss, weights = max_gap(against.series("loss"), run.series("loss")), weight_gap(against.weights, run.weights)
    holds = max(loss, weights) <= bound
    return Verdict(matrix.family, layout.name, layout.ranks, loss, None, weights, f"{bound:.0e}", holds, guarantee)


# name: (settings, bound on |Δloss| and |Δweight| vs one process, what it guarantees)
ROUNDED = {
    "bf16-autocast": (
        {"precision.dtype": "bf16"},
        5e-2,
        "bf16 compute (fp32 master weights) stays within 5e-2 of fp32",
    ),
    "fp16-compression": ({"comm.compression": "fp16"}, 1e-3, "gradients rounded to fp16 on the wire: within 1e-3"),
    "bf16-compression": ({"comm.compression": "bf16"}, 1e-2, "gradients rounded to bf16 on the wire: within 1e-2"),
}


def rounded(name: str) -> Callable[[Matrix, int], Verdict]:
    settings, bound, guarantee = ROUNDED[name]
    return lambda matrix, n: _within(matrix, CheckedLayout(name, n, settings), None, bound, guarantee)


def diloco_as_local_sgd(matrix: Matrix, n: int) -> Verdict:
    local = matrix.train(CheckedLayout("local-sgd-h2", n, {"sync.mode": "local_sgd", "sync.local_steps": 2}))
    settings = {"sync.mode": "diloco", "sync.local_steps": 2, "sync.outer_lr": 1.0, "sync.outer_momentum": 0.0}
    guarantee = "outer lr 1, momentum 0 equals local SGD (H = 2)"
    return _within(matrix, CheckedLayout("diloco-lr1-m0", n, settings), local, EXACT_TOLERANCE, guarantee)


def async_one_worker(matrix: Matrix, n: int) -> Verdict:
    settings = {"sync.mode": "parameter_server", "sync.ps_servers": 1, "sync.ps_async": True}
    guarantee = "with one worker nothing is stale: equals one process"
    return _within(matrix, CheckedLayout("ps-async-1w", 2, settings, servers=1), None, EXACT_TOLERANCE, guarantee)


def powersgd_warm_start(matrix: Matrix, n: int) -> Verdict:
    start = 2
    settings = {"comm.compression": "powersgd", "comm.powersgd_rank": 1, "comm.powersgd_start_step": start}
    ref, run = matrix.reference(), matrix.train(CheckedLayout("powersgd", n, settings))
    plain = max_gap(ref.series("loss")[: start + 1], run.series("loss")[: start + 1])
    sent = run.series("comm_bytes")
    compressed = bool(sent[0]) and bool(sent[-1]) and sent[-1] < sent[0] / 2
    measured = f"bytes/step {sent[0]} -> {sent[-1]}" if compressed else f"bytes/step {sent}: not compressed"
    return Verdict(
        matrix.family, "powersgd", n, plain, None, None, f"{EXACT_TOLERANCE:.0e}",
        plain <= EXACT_TOLERANCE and compressed,
        f"plain all-reduce before step {start} (losses 0..{start} exact), then < 1/2 the bytes", measured,
    )  # fmt: skip


def topk_bytes(matrix: Matrix, n: int) -> Verdict:
    """Top-k replaces plain DDP's gradient all-reduce (same model, same buckets) with at most k values and
    indices per bucket, and adds nothing: what else plain DDP's step sends stays (a model's own traffic, such as
    DeepSeek's broadcast of its router bias buffer and the all-reduce of tokens per expert that moves it; on
    step 1, DDP's rebuilt bucket order)."""
    ratio = 0.01
    layout = CheckedLayout("topk", n, {"comm.compression": "topk", "comm.topk_ratio": ratio})
    bucket_mb = load_config(None, layout.args(matrix.model)).comm.bucket_mb
    sent = matrix.train(layout).series("comm_bytes")
    plain = matrix.train(next(x for x in exact_layouts(n) if x.name == "ddp")).series("comm_bytes")
    numel = model_shape(matrix.model).params
    buckets = math.ceil(4 * numel / (bucket_mb * 2**20)) + 1  # DDP's first bucket is a small one
    per_rank_values = math.ceil(ratio * numel) + buckets  # sum over buckets of ceil(ratio x bucket size)
    bound = n * (n - 1) * 8 * per_rank_values  # each rank's values + int32 indices reach the n - 1 others
    # plain DDP's ring all-reduce of the fp32 gradient, 2(n - 1)/n of it from each rank, which the byte counter
    # rounds to whole bytes per bucket
    all_reduce, rounding = 8 * (n - 1) * numel, n * buckets / 2
    other = [None if p is None else p - all_reduce for p in plain]
    holds = len(sent) == len(other) and all(
        s is not None and o is not None and 0 < s <= bound + o + rounding for s, o in zip(sent, other, strict=True)
    )
    return Verdict(
        matrix.family, "topk", n, None, None, None, f"other + {bound:,} B/step", holds,
        f"each rank sends at most k = ceil({ratio} x size) values per bucket, beyond what plain DDP sends besides "
        "its gradient all-reduce", f"bytes/step {sent}, plain DDP's besides its all-reduce {other}",
    )  # fmt: skip


MOE = {"model.moe_experts": 4, "model.moe_top_k": 2}  # the family's model with MoE feed-forwards


def expert_parallel(matrix: Matrix, n: int) -> Verdict:
    """The MoE version of the family's model (the model itself if it has experts), its experts split over 2
    ranks (dropless), against its own one-process run: exact."""
    own = moe_options(matrix.model)
    moe = {} if own else MOE
    one = matrix.train(CheckedLayout("moe-one-process", 1, moe))
    experts, top_k = (own.experts, own.top_k) if own else (MOE["model.moe_experts"], MOE["model.moe_top_k"])
    guarantee = f"MoE ({experts} experts, top-{top_k}, dropless), experts over 2 ranks: equals one process"
    return _within(matrix, CheckedLayout("ep2-moe", 2, moe | {"parallel.ep": 2}), one, EXACT_TOLERANCE, guarantee)


# Methods held to a guarantee of their own (expert parallelism: exact, against a model of its own)
APPROXIMATE: dict[str, Callable[[Matrix, int], Verdict]] = {
    **{name: rounded(name) for name in ROUNDED},
    "powersgd": powersgd_warm_start,
    "topk": topk_bytes,
    "diloco": diloco_as_local_sgd,
    "ps-async": async_one_worker,
    "ep2-moe": expert_parallel,
}


def verify(
    nproc: int,
    only: list[str],
    work: Path,
    echo: Callable[[str], None] = print,
    families: list[str] | None = None,
) -> list[Verdict]:
    """Train and check the selected layouts for each family (default: all); each family's reference
    must itself have trained (loss went down)."""
    families = families or list(MODELS)
    unknown = [family for family in families if family not in MODELS]
    if unknown:
        raise UserError(f"--family {','.join(unknown)} is not a model family: use one of {', '.join(MODELS)}")
    exact = [layout for layout in exact_layouts(nproc) if layout.matches(only)]
    approximate = [check for name, check in APPROXIMATE.items() if not only or any(name_matches(name, w) for w in only)]
    if not exact and not approximate:
        raise UserError(f"--only {','.join(only)} selects no layout for {nproc} ranks")
    echo(f"paralm verify: {len(exact)} exact layouts and {len(approximate)} approximate methods on {nproc} ranks, "
         f"global batch {GLOBAL_BATCH}, families {', '.join(families)}")  # fmt: skip
    verdicts: list[Verdict] = []
    for family in families:
        matrix = Matrix(work, echo, family)
        losses = matrix.reference().series("loss")
        if not losses[-1] < losses[0]:
            raise RuntimeError(f"the one-process {family} reference did not train (losses {losses})")
        checks = [partial(check_context_parallel if "cp" in x.tags else check_exact, matrix, x) for x in exact]
        for check in [*checks, *(partial(check, matrix, nproc) for check in approximate)]:
            try:
                verdicts.append(check())
            except Refused as refused:
                echo(f"  skipped {family} {refused}")
    return verdicts


def table(verdicts: list[Verdict]) -> str:
    header = (
        "family",
        "layout",
        "ranks",
        "max |Δloss|",
        "max |Δgrad norm|",
        "max |Δweight|",
        "tolerance",
        "verdict",
        "guarantee",
    )
    rows = [header]
    for v in verdicts:
        extra = f"{v.guarantee}{'; ' + v.measured if v.measured else ''}"
        gaps = (_num(v.loss_gap), _num(v.grad_norm_gap), _num(v.weight_gap))
        rows.append((v.family, v.layout, str(v.ranks), *gaps, v.tolerance, "holds" if v.holds else "FAILS", extra))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows]
    held = sum(v.holds for v in verdicts)
    return "\n".join([*lines, f"{held}/{len(verdicts)} hold"])


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def echo_err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
