"""Multi-token prediction (DeepSeek-V3 §2.2) in paralm's DeepSeek: the modules' outputs, the loss and gradients
the step trains against a computation written from the report's equations (sequences of length T - k, the
shared embedding and head), the weight's schedule, the counts the planner and MFU read, the released layout
both ways, and the layouts refused."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from paralm.config.rules import validate
from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.models import deepseek_hf
from paralm.models.deepseek_spec import shape
from paralm.models.moe import MoE
from paralm.models.mtp import PredictionHook, mtp_weight, prediction_loss
from paralm.models.registry import model_config, model_spec
from paralm.models.step import StepBatch
from paralm.parallel.loss_head import ChunkedHead, PlainHead
from paralm.parallel.step import PlainStep
from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Workload
from paralm.plan.timing import step_time
from tests.models.test_deepseek import DEEPSEEK
from tests.plan.helpers import layout

MODEL = DEEPSEEK | {"moe_aux_loss": 0.0, "block_size": 16, "vocab_size": 64}  # no balance loss in the gradients


def build(depth: int, **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_spec(config := model_config(**(MODEL | {"mtp_depth": depth} | fields))).build(config)
    with torch.no_grad():  # far from init, so a swapped or mis-shifted input shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.train()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, MODEL["vocab_size"], (3, MODEL["block_size"] + 1), generator=torch.Generator().manual_seed(seed)
    )
    return tokens[:, :-1], tokens[:, 1:]


def by_hand(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss, mean over depths of the MTP cross-entropies), from the report's equations: depth k reads
    h^{k-1}_i and Emb(t_{i+k}) for i < T - k, M_k [RMSNorm(Emb); RMSNorm(h)], a block, the module's norm and the
    model's own head, and predicts t_{i+k+1}."""
    h = model.tok_embeddings(x)
    for block in model.layers.values():
        h = block(h)
    h = model.norm(h)
    main = F.cross_entropy(model.output(h).flatten(0, 1), y.flatten())
    seq, losses = x.shape[1], []
    for k, module in enumerate(model.mtp.depths.values(), start=1):
        embedded = model.tok_embeddings(x[:, k:])
        joined = torch.cat([module.enorm(embedded), module.hnorm(h[:, : seq - k])], dim=-1)
        h = module.block(joined @ module.eh_proj.weight.T)
        logits = model.output(module.norm(h))
        losses.append(F.cross_entropy(logits.flatten(0, 1), y[:, k:].flatten()))
    return main, torch.stack(losses).mean()


@pytest.mark.parametrize("depth", [1, 2])
def test_the_modules_predict_further_tokens_as_the_report_writes(depth):
    model, (x, y) = build(depth), batch()
    logits = model(x)
    assert [tuple(out.shape) for out in model.mtp.outputs] == [tuple(logits.shape)] * depth
    model.mtp.weight = 0.3
    loss = prediction_loss(model, PlainHead(), y, None, 1.0)
    main, ahead = by_hand(model, x, y)
    torch.testing.assert_close(F.cross_entropy(logits.flatten(0, 1), y.flatten()), main)
    torch.testing.assert_close(loss, 0.3 * ahead)
    torch.testing.assert_close(model.mtp.summed, ahead.detach())
    assert prediction_loss(model, PlainHead(), y, None, 1.0) is None  # each forward's outputs are taken once
    model(x, hidden=True)  # the chunked head multiplies the modules' final norm output by the shared head
    chunked = prediction_loss(model, ChunkedHead(model.output, 3, torch.float32), y, None, 1.0)
    torch.testing.assert_close(chunked, 0.3 * ahead)


def test_evaluation_and_generation_run_no_module():
    model, plain, (x, _) = build(1), build(0).eval(), batch()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    model.eval()
    torch.testing.assert_close(model(x), plain(x))  # the main model is the one without MTP
    assert model.mtp.outputs == []


def test_the_step_trains_the_weighted_sum_with_the_shared_embedding_and_head():
    """One micro-batch of `PlainStep`: the gradients are those of loss + λ L_MTP by hand, with λ the
    hook's weight of the step; the reported loss is the next-token loss alone."""
    model, (x, y) = build(2), batch()
    hook = PredictionHook(model, lambda step: mtp_weight(step, first=0.3, after=0.1, switch=5))
    hook.started(5)
    step = PlainStep(model, torch.device("cpu"), "fp32")
    reported = step.forward_backward(StepBatch([(x, y)]), lambda loss: loss)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    main, ahead = by_hand(model, x, y)
    (main + 0.1 * ahead).backward()
    torch.testing.assert_close(reported, main.detach())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    assert grads["mtp.depths.1.eh_proj.weight"].abs().sum() > 0
    torch.testing.assert_close(hook.ended(5, torch.tensor(False))["mtp_loss"], ahead.detach())
    assert hook.ended(6, torch.tensor(False))["mtp_loss"] == 0  # taken once per step


def test_the_weight_follows_its_schedule():
    assert [mtp_weight(step, 0.3, 0.1, 2) for step in range(4)] == [0.3, 0.3, 0.1, 0.1]
    assert mtp_weight(10**9, 0.3, 0.1, 0) == 0.3  # 0: never switches


@pytest.mark.parametrize("first_dense", [1, 4])  # the module's block MoE (as the released V3's) or dense
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_counts_and_flops_include_the_modules(depth, first_dense):
    model = build(depth, moe_first_dense=first_dense)
    config, without = model.config, shape(dataclasses.replace(model.config, mtp_depth=0))
    counted = shape(config)
    assert counted.params == sum(p.numel() for p in model.parameters())
    if depth == 0:
        return
    modules = model.mtp.depths.values()
    own = sum(p.numel() for p in model.mtp.parameters())
    assert counted.params - without.params == own
    routed = [m.block.feed_forward for m in modules if isinstance(m.block.feed_forward, MoE)]
    unused = sum((f.experts.w1[0].numel() * 3) * (f.options.experts - f.options.top_k) for f in routed)
    head = model.output.weight.numel()
    attention = 12 * depth * config.d_model * config.block_size
    assert counted.flops_per_token - without.flops_per_token == 6 * (own - unused + depth * head) + attention


def test_the_planner_prices_the_modules_on_the_last_stage():
    """One more block and one more pass through the head per module: the step's compute grows by about
    what one block and the head cost (the model has 3 blocks)."""
    cluster = PRESETS["h100"].with_devices(1)
    times = []
    for depth in (0, 1):
        work = Workload(shape(model_config(**MODEL, mtp_depth=depth)), 8, "bf16", "fp32", 2, False, "paper", 0)
        times.append(step_time(layout(micro_batch_size=8), work, cluster).compute_s)
    assert 1.15 < times[1] / times[0] < 1.6, times


def test_the_released_layout_round_trips_the_modules():
    model = build(1)
    config, state = model.config, {k: v.detach() for k, v in model.state_dict().items()}
    hf = deepseek_hf.to_hf(state, config)
    n = config.n_layer
    for name in ("eh_proj", "enorm", "hnorm", "shared_head.norm", "mlp.gate", "self_attn.kv_b_proj"):
        assert f"model.layers.{n}.{name}.weight" in hf, name
    torch.testing.assert_close(hf[f"model.layers.{n}.shared_head.head.weight"], hf["lm_head.weight"])
    torch.testing.assert_close(hf[f"model.layers.{n}.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    back = deepseek_hf.from_hf(hf, config, "folder")
    assert back.keys() == state.keys()
    for name, value in state.items():
        torch.testing.assert_close(back[name], value, rtol=0, atol=0, msg=name)
    held = {piece.ours for piece in deepseek_hf.pieces(config, hf.keys())}  # init_from reads the modules too
    assert {name for name in state if name.startswith("mtp.")} <= held
    # a run without modules skips the folder's prediction layer (its main weights load as they are)
    plain = deepseek_hf.from_hf(hf, dataclasses.replace(config, mtp_depth=0), "folder")
    assert plain.keys() == {name for name in state if not name.startswith("mtp.")}
    assert deepseek_hf.config_to_hf(config)["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("parallel", [{"pp": 2}, {"tp": 2}, {"cp": 2}])
def test_layouts_the_modules_do_not_run_under_are_refused_in_one_line(parallel):
    config = Config.from_dict({"model": MODEL | {"mtp_depth": 1}, "parallel": parallel})
    name = next(iter(parallel))
    with pytest.raises(UserError, match=f"parallel.{name} > 1 is not supported with model.mtp_depth > 0"):
        validate(config)


def test_a_negative_weight_is_refused():
    with pytest.raises(UserError, match="train.mtp_weight"):
        validate(Config.from_dict({"model": MODEL | {"mtp_depth": 1}, "train": {"mtp_weight": -1.0}}))
