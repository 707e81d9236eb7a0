"""Readable tables of plans: the layout, its memory and step time term by term, tokens/s and MFU."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from paralm.plan.cluster import Cluster, GiB
from paralm.plan.layout import Layout, Workload
from paralm.plan.search import Prediction

Column = tuple[str, Callable[[Prediction], str]]  # header, formatted value


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f}"


def seconds(seconds: float) -> str:
    return f"{seconds:,.0f}" if seconds >= 100 else f"{seconds:.3g}"


LAYOUT_COLUMNS: list[Column] = [
    ("dp", lambda p: f"{p.layout.dp_replicate}x{p.layout.dp_shard}" if p.layout.dp_replicate > 1 else str(p.layout.dp)),
    ("zero", lambda p: str(p.layout.zero)),
    ("tp", lambda p: f"{p.layout.tp}{'+sp' if p.layout.sequence_parallel else ''}"),
    ("cp", lambda p: f"{p.layout.cp} {p.layout.cp_method}" if p.layout.cp > 1 else "1"),
    ("pp", lambda p: str(p.layout.pp)),
    ("ep", lambda p: str(p.layout.ep)),
    ("schedule", lambda p: _schedule(p)),
    ("mbs", lambda p: str(p.layout.micro_batch_size)),
    ("accum", lambda p: str(p.layout.grad_accum)),
    ("ckpt", lambda p: p.layout.activation_checkpointing),
]
MEMORY_COLUMNS: list[Column] = [
    ("param", lambda p: _gib(p.memory.param_bytes)),
    ("grad", lambda p: _gib(p.memory.grad_bytes)),
    ("optim", lambda p: _gib(p.memory.optim_bytes)),
    ("activ", lambda p: _gib(p.memory.activation_bytes)),
    ("other", lambda p: _gib(p.memory.embedding_bytes + p.memory.logits_bytes + p.memory.buffer_bytes)),
    ("GiB", lambda p: _gib(p.memory.total)),
]
TIME_COLUMNS: list[Column] = [
    ("compute", lambda p: seconds(p.time.compute_s + p.time.recompute_s)),
    ("bubble", lambda p: seconds(p.time.bubble_s)),
    (
        "comm",
        lambda p: seconds(
            p.time.tp_comm_s
            + p.time.pp_comm_s
            + p.time.dp_exposed_s
            + p.time.embedding_sync_s
            + p.time.cp_comm_s
            + p.time.ep_comm_s
        ),
    ),
    ("optim", lambda p: seconds(p.time.optimizer_s)),
    ("step s", lambda p: seconds(p.time.total) + (f" ± {p.band.error:.0%}" if p.band else "")),
    ("tokens/s", lambda p: f"{p.tokens_per_s:,.0f}"),
    ("MFU", lambda p: f"{p.mfu:.1%}"),
]


def layout_text(lay: Layout) -> str:
    """A layout in one line: its degrees, schedule, micro-batch and checkpointing."""
    text = f"dp {lay.dp_replicate}x{lay.dp_shard} zero {lay.zero} tp {lay.tp}{'+sp' if lay.sequence_parallel else ''}"
    text += f" pp {lay.pp}"
    if lay.pp > 1:
        virtual = f" v{lay.pp_virtual_stages}" if lay.pp_virtual_stages > 1 else ""
        text += f" {lay.pp_schedule}{virtual} m{lay.pp_microbatches}"
    if lay.cp > 1:
        text += f" cp {lay.cp} {lay.cp_method}"
    if lay.ep > 1:
        text += f" ep {lay.ep}"
    return text + f" mbs {lay.micro_batch_size} ckpt {lay.activation_checkpointing}"


def _schedule(plan: Prediction) -> str:
    lay = plan.layout
    if lay.pp == 1:
        return "-"
    chunks = f" v{lay.pp_virtual_stages}" if lay.pp_virtual_stages > 1 else ""
    return f"{lay.pp_schedule}{chunks} m{lay.pp_microbatches}"


def table(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    """Right-aligned columns, a rule under the headers."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


MEASURED_COLUMNS: list[Column] = [
    ("measured mb s", lambda p: seconds(p.measured_compute_s)),
    ("step s measured", lambda p: seconds(p.measured_step_s)),
]


def plans_table(plans: Sequence[Prediction]) -> str:
    """One row per plan; with `--measure` (every plan measured) the measured compute per pipeline micro-batch
    and the step priced with it."""
    measured = MEASURED_COLUMNS if plans and all(p.measured_compute_s is not None for p in plans) else []
    columns = LAYOUT_COLUMNS + MEMORY_COLUMNS + TIME_COLUMNS + measured
    rows = [[str(i + 1)] + [value(p) for _, value in columns] for i, p in enumerate(plans)]
    return table(rows, ["#"] + [h for h, _ in columns])


def band_line(plan: Prediction) -> str:
    """The best plan's step time with its band, and the tokens/s and MFU ranges that follow; which runs set it."""
    band, t = plan.band, plan.time.total
    if band is None:
        return ""
    low, high = band.span(t)
    return (
        f"best: step {seconds(t)} s ± {band.error:.0%} ({seconds(low)}-{seconds(high)} s), "
        f"{plan.tokens_per_s * t / high:,.0f}-{plan.tokens_per_s * t / low:,.0f} tokens/s, "
        f"MFU {plan.mfu * t / high:.1%}-{plan.mfu * t / low:.1%}; ± is the held-out error (rms) of the "
        f"{band.rows} published runs most like it ({band.basis}): paralm plan --validate"
    )


def summary(work: Workload, cluster: Cluster, recipe: str, overlap: bool) -> str:
    shape = work.shape
    small, large = cluster.gemm_efficiency[0], cluster.gemm_efficiency[-1]
    kv = f" ({shape.n_kv_heads} key/value)" if shape.n_kv_heads != shape.n_head else ""
    head = ", untied head" if shape.head_params else ""
    return "\n".join(
        [
            f"model: {shape.params / 1e9:.3g}B parameters ({shape.n_layer} layers, d_model {shape.d_model}, "
            f"{shape.n_head} heads{kv}, context {shape.block_size}, vocab {shape.vocab_size}{head}), "
            f"{shape.flops_per_token / 1e9:,.4g} GFLOP per token (6N + 12Lds)",
            f"cluster: {cluster.name}, {cluster.devices} devices ({cluster.nodes} x {cluster.devices_per_node}), "
            f"{cluster.memory_bytes / GiB:.1f} GiB each, {cluster.peak(work.dtype) / 1e12:.4g} TFLOP/s "
            f"{work.dtype} peak; matmuls reach {small[1]:.0%} of it at size {small[0]:g}, "
            f"{large[1]:.0%} at {large[0]:g}",
            f"batch: {work.global_batch} sequences ({work.tokens_per_step:,} tokens) per step; model states as "
            f"'{recipe}'; communication {'overlapped as stated' if overlap else 'never overlapped'}",
            "memory in GiB per device (other: embedding, logits and loss, buffers; a runtime allowance of "
            f"{cluster.runtime_bytes / GiB:.2f} GiB is in the total); times in seconds per step",
        ]
    )
