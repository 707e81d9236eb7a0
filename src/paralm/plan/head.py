"""The LM head and its loss as the planner prices them, per `train.loss_impl` and `train.compile`: seconds of
the head's matmuls and of the loss's memory-bound work, and the bytes the loss holds at the step's peak.

`train.loss_impl` is resolved per layout as the trainer resolves it (`paralm.parallel.loss_head.loss_impl`) on
the cluster's device (`device_type`): a GPU, where Liger Kernel is assumed installed (the planned machines'
installs are unknown here), so auto is fused at tp = 1 and chunked above; a CPU, where auto is chunked. For a
micro-batch of N tokens on a rank whose vocabulary shard is V/t wide (t: the tensor-parallel degree):

- plain (`paralm.models.loss.cross_entropy_loss`): the (N x d) by (d x V/t) matmul, once forward and twice
  backward; the loss reads the 16-bit logits, writes their fp32 copy and its log-probabilities, backward their
  gradient and the logits' (`EAGER_LOSS_BYTES` a logit in each of the three passes). At the peak it holds the
  fp32 log-probabilities, their gradient, the logits' gradient and that gradient cast to 16 bits.
- chunked (`paralm.models.loss.chunked_cross_entropy`): forward takes `train.loss_chunks` slices of the tokens,
  computes each slice's logits in fp32, its loss and their gradient in place (`CHUNKED_LOSS_BYTES` a logit, in
  `CHUNKED_LOSS_KERNELS` eager kernels), and multiplies that into the hidden states' and the weight's gradients
  there and then: plain's three matmuls, in slices, nothing recomputed; under mixed precision each slice's
  weight gradient is a 16-bit product added into the fp32 one. It keeps those two gradients (fp32: the weight's,
  and the hidden states', the final norm's output) to backward, which only scales them. At the peak: those, the
  16-bit product, and two slices' fp32 logits and 16-bit gradient (its loop holds the last slice's while it
  computes the next's; measured on the CPU, docs/planning.md).
- fused: Liger Kernel's fused linear cross-entropy (`fused_linear_cross_entropy_forward`,
  linkedin/Liger-Kernel src/liger_kernel/ops/fused_linear_cross_entropy.py @ 00eba634c2e9). Its forward takes
  chunks of next_power_of_2(ceil(N / ceil(V / d))) tokens (`fused_chunk`: a chunk's logits about N x d), computes
  each chunk's logits, then its loss and their gradient in place (one Triton kernel: the logits read twice,
  the gradient written once, `FUSED_PASSES`), then from it the input's and the weight's gradients; it keeps
  those two gradients (the weight's in the dtype it is given: paralm passes it cast to the compute dtype)
  to backward, which only scales them. The same three matmuls as plain, no fp32 logits, nothing recomputed.

`train.compile = model` compiles the loss with the model (`Workload.compiled_head`): inductor fuses plain's
casts, softmax and gradient into a kernel a pass that reads or writes the 16-bit logits once, chunked's into a
kernel a slice as Liger's (`FUSED_PASSES`); blocks and off leave the loss eager; Liger's kernels are fused
already. The embedding lookup and the final norm, d_model wide per token (a vocabulary's width less than the
loss), are left out, compiled or not; so is what inductor would save in place of the eager fp32 tensors (the
memory stays eager's, an upper bound).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from paralm.errors import UserError
from paralm.parallel.loss_head import loss_impl
from paralm.plan.cluster import Cluster
from paralm.plan.kernels import matmul
from paralm.plan.layout import Workload

# Bytes per logit per pass beyond the 16-bit logits' own read, eager: the fp32 copy written, the fp32
# log-probabilities written and read back (backward: their gradient and the logits' alike); in three kernels.
EAGER_LOSS_BYTES, EAGER_LOSS_KERNELS = 12, 3
# Chunked's forward, a logit, beyond the 16-bit logits' own read and the 16-bit gradient's write: the fp32 copy
# written, read for the max, read and written for the exponentials, read for their sum and for the cast back;
# the cast, the max, the target's gather, the subtraction, the exponential, the sum, the scatter, the cast back.
CHUNKED_LOSS_BYTES, CHUNKED_LOSS_KERNELS = 24, 8
# A fused loss kernel (Liger's; chunked's under `train.compile = model`): the logits read for the log-sum-exp,
# read again and overwritten by their gradient
FUSED_PASSES = 3

COMPILE_TEXT = {
    "off": "nothing compiled",
    "blocks": "each block's elementwise work fused; the embedding, final norm, head and loss eager",
    "model": "the blocks' and the loss's elementwise work fused",
}


@dataclass(frozen=True)
class HeadTimes:
    """Seconds of the head and its loss for one micro-batch on one rank, by pass (as `kernels.BlockTimes`)."""

    forward: float
    input_gradients: float
    weight_gradients: float

    def scaled(self, factor: float) -> HeadTimes:
        return HeadTimes(*(factor * getattr(self, f.name) for f in dataclasses.fields(self)))


def device_type(cluster: Cluster) -> str:
    """The device the trainer would run on: a CPU for a cluster `paralm calibrate` measured on CPUs (its name is
    cpu-...), else a CUDA GPU (the presets, a calibrated GPU)."""
    return "cpu" if cluster.name.startswith("cpu") else "cuda"


def resolved(work: Workload, cluster: Cluster, tp: int) -> str:
    """The loss head a layout of `tp` trains with (a one-line `UserError` where the one asked for cannot run)."""
    return loss_impl(work.loss_impl, device_type(cluster), tp, liger_installed=True)


def tp_problem(name: str, tp: int) -> str | None:
    """Why `train.loss_impl = name` cannot train at `tp` on a GPU (fused computes the whole vocabulary), if not."""
    try:
        loss_impl(name, "cuda", tp, liger_installed=True)
    except UserError as refused:
        return str(refused)
    return None


def compile_mode(work: Workload) -> str:
    return "model" if work.compiled_head else "blocks" if work.compiled else "off"


def fused_chunk(tokens: int, vocab: int, d: int) -> int:
    """Tokens per chunk of Liger's fused linear cross-entropy (its rule at its default memory budget)."""
    wanted = max(1, math.ceil(tokens / math.ceil(vocab / d)))
    return max(1, min(1 << (wanted - 1).bit_length(), tokens))


def head_times(cluster: Cluster, work: Workload, impl: str, sequences: int, t: int, cp: int = 1) -> HeadTimes:
    """The head's matmuls and the loss `impl` computes on this rank's positions, each a roofline (`kernels`)."""
    shape, e, bandwidth, launch = work.shape, work.element_bytes, cluster.memory_bandwidth, cluster.kernel_latency
    tokens, vocab, d = sequences * shape.block_size // cp, shape.vocab_size / t, shape.d_model
    if impl == "plain":
        head = matmul(cluster, work.dtype, tokens, vocab, d, e)
        per_logit, kernels = (e, 1) if work.compiled_head else (e + EAGER_LOSS_BYTES, EAGER_LOSS_KERNELS)
        per_pass = head + tokens * vocab * per_logit / bandwidth + kernels * launch
        return HeadTimes(per_pass, per_pass, per_pass)
    # chunked and fused: the gradients in forward, a slice (a chunk) of the tokens at a time; backward scales them
    if impl == "fused":
        rows, per_logit, kernels, grad_bytes = fused_chunk(tokens, shape.vocab_size, d), FUSED_PASSES * e, 1, e
        product = 0.0  # Liger accumulates the weight's gradient in place, in the dtype it is given
    else:
        rows = max(1, math.ceil(tokens / work.loss_chunks))
        fused = work.compiled_head
        per_logit = FUSED_PASSES * e if fused else CHUNKED_LOSS_BYTES + 2 * e
        kernels, grad_bytes = 1 if fused else CHUNKED_LOSS_KERNELS, 4
        product = vocab * d * (2 * e + 8) if e < 4 else 0.0  # a 16-bit product written, read, added to fp32
    slices = max(1, math.ceil(tokens / rows))
    matmuls = 3 * slices * matmul(cluster, work.dtype, min(rows, tokens), vocab, d, e)
    gradients = (tokens + vocab) * d * grad_bytes  # the hidden states' and the weight's, zeroed forward
    loss = (tokens * vocab * per_logit + slices * product + gradients) / bandwidth + slices * kernels * launch
    return HeadTimes(matmuls + loss, 2 * gradients / bandwidth + 2 * launch, 0.0)  # backward scales them in place


def loss_bytes(work: Workload, impl: str, tokens: int, t: int) -> float:
    """Bytes the final norm, head and loss hold at the step's peak for one micro-batch of `tokens` on a rank:
    the final norm's input and output (2 sbh elements) and what `impl` keeps (see the module's note)."""
    shape, e = work.shape, work.element_bytes
    vocab, d = shape.vocab_size / t, shape.d_model
    norm, cast = 2 * e * tokens * d, e if e < 4 else 0  # cast: the logits' gradient in 16 bits
    if impl == "fused":
        chunk = fused_chunk(tokens, shape.vocab_size, d)
        return norm + e * (chunk * vocab + tokens * d + vocab * d) + 4 * tokens  # + its fp32 per-token losses
    if impl == "chunked":
        rows = math.ceil(tokens / work.loss_chunks)
        gradients = 4 * (tokens + vocab) * d + cast * vocab * d  # fp32, and the 16-bit product of a slice
        return norm + 2 * rows * vocab * (4 + cast) + gradients
    return norm + tokens * vocab * (12 + cast)


def assumed_line(work: Workload, cluster: Cluster, tp: int) -> str:
    """What `paralm plan` assumed of the loss head and compile mode, from the config it was given; `tp`: the best
    layout's, where auto depends on it."""
    impl = resolved(work, cluster, tp)
    how = f"{impl} in {work.loss_chunks} slices" if impl == "chunked" else impl
    head = f"train.loss_impl = {how}"
    if work.loss_impl == "auto":
        gpu = device_type(cluster) == "cuda"
        rule = "on a GPU: fused at tp 1, chunked above, Liger Kernel assumed installed" if gpu else "on a CPU: chunked"
        head = f"train.loss_impl = auto, priced as {how} for the best layout (tp {tp}; auto {rule})"
    mode = compile_mode(work)
    return f"assumed: {head}; train.compile = {mode}: {COMPILE_TEXT[mode]}"
