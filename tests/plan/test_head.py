"""The planner prices the loss head and compile mode a config asks for (`paralm.plan.head`): chunked and fused
(Liger Kernel's) compute the gradients in forward a slice of the tokens at a time, holding no whole logits,
`train.compile = model` fuses the loss's elementwise work, auto resolves as the trainer would on the cluster's
device, and `paralm plan` says what it assumed."""

import dataclasses
import json

import pytest

from paralm.cli import main
from paralm.errors import UserError
from paralm.models.registry import model_config, model_shape
from paralm.plan.head import fused_chunk, head_times, resolved
from paralm.plan.memory import device_memory
from paralm.plan.request import load_request
from paralm.plan.search import evaluate, search
from tests.plan.helpers import H100, SMALL_LLAMA, layout, small_work

VOCAB = 128256  # Llama 3's
# A head-heavy model: Llama 3's vocabulary on a narrow, shallow body.
HEAD_HEAVY = model_shape(model_config(n_layer=2, n_head=8, d_model=1024, block_size=2048, vocab_size=VOCAB))
CPU = dataclasses.replace(H100, name="cpu-2-threads")


def _work(**fields):
    return dataclasses.replace(small_work(batch=4), **({"shape": HEAD_HEAVY} | fields))


def _price(layout_fields: dict | None = None, **fields):
    return evaluate(layout(micro_batch_size=4, **(layout_fields or {})), _work(**fields), H100)


def test_chunked_holds_less_than_plain_by_about_the_logits():
    plain, chunked = (_price(loss_impl=impl).memory for impl in ("plain", "chunked"))
    tokens = 4 * HEAD_HEAVY.block_size
    saved = plain.logits_bytes - chunked.logits_bytes
    # at least the fp32 logits themselves, at most every (tokens, vocab) tensor plain keeps (fp32 and 16-bit)
    assert tokens * VOCAB * 4 < saved < tokens * VOCAB * (3 * 4 + 2)
    assert plain.total - chunked.total == pytest.approx(saved)
    # a slice of the tokens: more slices, less held
    finer = _price(loss_impl="chunked", loss_chunks=32).memory
    assert finer.logits_bytes < chunked.logits_bytes


def test_chunked_computes_its_gradients_in_forward_with_plains_three_matmuls():
    """Chunked runs the head's three matmuls and the loss's gradient in forward; backward only scales what it
    kept. In fp32 (no 16-bit product to add) its step is plain's within one head matmul: nothing recomputed."""
    plain, chunked = (_price(loss_impl=impl, dtype="fp32") for impl in ("plain", "chunked"))
    matmul = HEAD_HEAVY.head_forward_flops(4 * HEAD_HEAVY.block_size) / H100.peak("fp32")
    assert chunked.time.recompute_s == plain.time.recompute_s == 0
    assert abs(chunked.time.total - plain.time.total) < matmul
    times = head_times(H100, _work(loss_impl="chunked"), "chunked", 4, 1)
    assert times.weight_gradients == 0 and times.input_gradients < 0.05 * times.forward
    assert times.forward > 3 * matmul * H100.peak("fp32") / H100.peak("bf16")


def test_fused_keeps_gradients_in_the_compute_dtype_and_no_fp32_logits():
    plain, chunked, fused = (_price(loss_impl=impl) for impl in ("plain", "chunked", "fused"))
    assert fused.memory.logits_bytes < chunked.memory.logits_bytes < plain.memory.logits_bytes
    # no fp32 logits to write and read: faster than plain and chunked
    assert fused.time.total < min(plain.time.total, chunked.time.total)


def test_fused_chunks_as_liger_kernel_does():
    """The worked example in Liger Kernel's fused_linear_cross_entropy.py: BT = 4096 * 4, V = 32000, H = 4096 give
    chunks of 2048 tokens; never more than the tokens there are."""
    assert fused_chunk(4096 * 4, 32000, 4096) == 2048
    assert fused_chunk(100, VOCAB, 4096) == 4 and fused_chunk(3, 10, 4096) == 3


def test_compile_model_fuses_the_loss_that_blocks_leaves_eager():
    modes = ((False, False), (True, False), (True, True))  # train.compile = off, blocks, model
    off, blocks, model = (_price(compiled=compiled, compiled_head=head) for compiled, head in modes)
    assert model.time.total < blocks.time.total < off.time.total
    chunked = [_price(loss_impl="chunked", compiled=True, compiled_head=head).time.total for head in (False, True)]
    assert chunked[1] < chunked[0]
    # the head's share is what model adds to blocks: the more of the step the head is, the larger its gain
    narrow = model_shape(model_config(n_layer=2, n_head=8, d_model=1024, block_size=2048, vocab_size=8192))
    gain = blocks.time.total - model.time.total
    small = [
        evaluate(layout(micro_batch_size=4), _work(shape=narrow, compiled=True, compiled_head=head), H100)
        for head in (False, True)
    ]
    assert 0 < small[0].time.total - small[1].time.total < gain


def test_auto_resolves_as_the_trainer_would_on_the_clusters_device():
    work = _work(loss_impl="auto")
    assert resolved(work, H100, 1) == "fused" and resolved(work, H100, 2) == "chunked"
    assert resolved(work, CPU, 1) == "chunked"
    assert _price(loss_impl="auto").memory == _price(loss_impl="fused").memory
    with pytest.raises(UserError, match="loss_impl = fused"):
        device_memory(layout(), _work(loss_impl="fused"), CPU)


def test_a_search_for_fused_leaves_out_tensor_parallel_layouts():
    config, fixed = load_request(None, [*SMALL_LLAMA, "--train.loss_impl=fused", "--train.global_batch_size=8"])
    _, plans = search(config, H100.with_devices(8), fixed)
    assert plans and {p.layout.tp for p in plans} == {1}
    config, fixed = load_request(None, [*SMALL_LLAMA, "--train.loss_impl=fused", "--parallel.tp=2"])
    with pytest.raises(UserError, match="parallel.tp > 1"):
        search(config, H100.with_devices(8), fixed)


def test_plan_says_which_loss_head_and_compile_mode_it_assumed(capsys):
    args = ["plan", *SMALL_LLAMA, "--cluster", "h100:8", "--top", "1", "--train.global_batch_size=8"]
    assert main([*args, "--train.loss_impl=chunked", "--train.loss_chunks=4", "--train.compile=blocks"]) == 0
    out = capsys.readouterr().out
    assert "assumed: train.loss_impl = chunked in 4 slices; train.compile = blocks" in out
    assert main([*args, "--parallel.tp=2", "--train.loss_impl=auto"]) == 0
    assert "train.loss_impl = auto, priced as chunked in 8 slices for the best layout (tp 2" in capsys.readouterr().out


def test_a_dry_run_prices_the_compile_mode_the_job_trains_with(tmp_path, capsys):
    """The rehearsal builds the model eager, but its planned step is the job's: compiled blocks, priced so."""
    steps = {}
    for mode in ("off", "blocks"):
        argv = [*SMALL_LLAMA, "--parallel.zero=3", f"--train.compile={mode}", "--train.loss_impl=plain"]
        argv.append(f"--run.dir={tmp_path / mode}")
        assert main(["train", *argv, "--dry-run", "8", "--cluster", "h100"]) == 0
        assert f"dry run: assumed: train.loss_impl = plain; train.compile = {mode}" in capsys.readouterr().out
        steps[mode] = json.loads((tmp_path / mode / "dry_run.json").read_text())["step_time"]["step_time_s"]
    assert steps["blocks"] < steps["off"]
