"""`paralm verify`'s own definition, run on a reduced matrix: the layouts CI checks are the ones users check."""

import pytest

from paralm.cli import main
from paralm.evidence.matrix import GLOBAL_BATCH, CheckedLayout, exact_layouts
from paralm.evidence.verify import Matrix, check_exact, table, topk_bytes, verify


@pytest.mark.slow
def test_verify_on_two_ranks_holds_for_sharded_tensor_and_pipeline_layouts(tmp_path):
    verdicts = verify(2, ["zero3", "tp2-sp", "pp2-interleaved_1f1b"], tmp_path, echo=lambda _: None, families=["gpt2"])
    assert [v.layout for v in verdicts] == ["zero3", "tp2-sp", "pp2-interleaved_1f1b"]
    for v in verdicts:
        assert v.holds and max(v.loss_gap, v.grad_norm_gap, v.weight_gap) <= 1e-5, table(verdicts)


@pytest.mark.slow
def test_verify_holds_a_reduced_llama_matrix_with_grouped_query_attention_under_tp(tmp_path):
    only = ["ddp", "zero2", "zero3", "tp2-sp", "pp2-1f1b", "pp2-interleaved_1f1b", "cp2-ring", "ps-sync-1s1w"]
    only.append("local-sgd-h1")
    verdicts = verify(2, only, tmp_path, echo=lambda _: None, families=["llama"])
    assert {v.family for v in verdicts} == {"llama"}
    assert [v.layout for v in verdicts] == [
        "ddp", "ddp-compression-none", "zero2", "zero3", "tp2-sp", "pp2-1f1b", "pp2-interleaved_1f1b", "cp2-ring",
        "ps-sync-1s1w", "local-sgd-h1",
    ]  # fmt: skip
    cp = next(v for v in verdicts if v.layout == "cp2-ring")  # exact, and sent the ring's k/v traffic beyond ddp's
    assert "bytes/step beyond ddp: 1572864, the planner's cp bytes 1572864" in cp.measured
    for v in verdicts:
        gaps = [g for g in (v.loss_gap, v.grad_norm_gap, v.weight_gap) if g is not None]
        assert v.holds and len(gaps) >= 2 and max(gaps) <= 1e-5, table(verdicts)


@pytest.mark.slow
def test_a_layout_that_trains_differently_fails_the_check(tmp_path):
    matrix = Matrix(tmp_path, echo=lambda _: None)
    different = CheckedLayout("ddp-other-lr", 2, {"train.lr": 0.31})  # a 3% change of the learning rate
    verdict = check_exact(matrix, different)
    assert not verdict.holds and verdict.weight_gap > 1e-4
    assert "FAILS" in table([verdict])


def test_the_matrix_grows_with_the_ranks_and_only_selects_by_name():
    two, four, eight = (exact_layouts(n) for n in (2, 4, 8))
    assert {"ddp", "zero1", "zero2", "zero3", "tp2", "tp2-sp", "pp2-gpipe", "pp2-dualpipev", "local-sgd-h1"} <= {
        layout.name for layout in two
    }
    assert any(layout.name.startswith("hsdp") for layout in four) and not any("hsdp" in x.name for x in two)
    assert any(layout.name.startswith("3d") for layout in eight) and not any("3d" in x.name for x in four)
    for n, layouts in ((2, two), (4, four), (8, eight)):
        assert all(layout.ranks <= n and GLOBAL_BATCH % layout.dp == 0 for layout in layouts)  # same global batch
    assert [x.name for x in two if x.matches(["zero"])] == ["zero1", "zero2", "zero3"]


def test_verify_refuses_one_rank_selections_that_select_nothing_and_a_missing_work_folder(capsys, tmp_path):
    assert main(["verify", "--nproc", "1"]) == 2
    assert main(["verify", "--nproc", "2", "--only", "nothing-like-this"]) == 2
    assert main(["verify", "--nproc", "2", "--family", "bert"]) == 2
    assert main(["verify", "--nproc", "2", "--work", str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err.count("paralm: error:") == 4


@pytest.mark.slow
def test_verify_holds_the_parameter_servers_and_diloco_to_their_guarantees(tmp_path):
    verdicts = verify(2, ["ps", "diloco"], tmp_path, echo=lambda _: None, families=["gpt2"])
    assert [v.layout for v in verdicts] == ["ps-sync-1s1w", "diloco-lr1-m0", "ps-async-1w"]
    assert all(v.holds and v.weight_gap <= 1e-5 for v in verdicts), table(verdicts)


@pytest.mark.slow
def test_verify_holds_expert_parallelism_to_one_process(tmp_path):
    verdicts = verify(2, ["ep2"], tmp_path, echo=lambda _: None, families=["llama"])
    assert [v.layout for v in verdicts] == ["ep2-moe"]
    assert verdicts[0].holds and max(verdicts[0].loss_gap, verdicts[0].weight_gap) <= 1e-5, table(verdicts)


def test_layouts_a_familys_rules_refuse_are_named_with_their_line(tmp_path):
    matrix = Matrix(tmp_path, echo=lambda _: None, family="deepseek")
    assert matrix.refusal(CheckedLayout("ddp", 2, {})) is None
    assert matrix.refusal(CheckedLayout("cp2-ring", 2, {"parallel.cp": 2, "parallel.cp_method": "ring"})) is None
    assert "parallel.cp > 1 with parallel.ep > 1" in matrix.refusal(
        CheckedLayout("cp2-ep2", 2, {"parallel.cp": 2, "parallel.ep": 2})
    )
    ps = CheckedLayout("ps", 2, {"sync.mode": "parameter_server", "sync.ps_servers": 1}, servers=1)
    assert "parameter_server" in matrix.refusal(ps)


@pytest.mark.slow
def test_verify_holds_the_deepseek_family_on_every_layout(tmp_path):
    """Latent attention, shared + routed experts with group-limited sigmoid routing and the loss-free bias:
    ZeRO-3, TP with sequence parallelism, a zero-bubble pipeline (its weight gradients split from backward;
    each stage's auxiliary loss carried through it), ring context parallelism (the balance terms completed over
    the cp ranks) and its experts over 2 ranks equal one process."""
    lines: list[str] = []
    only = ["zero3", "tp2-sp", "cp2-ring", "pp2-zbv_zero_bubble", "ep2"]
    verdicts = verify(2, only, tmp_path, echo=lines.append, families=["deepseek"])
    assert [v.layout for v in verdicts] == ["zero3", "tp2-sp", "pp2-zbv_zero_bubble", "cp2-ring", "ep2-moe"]
    assert all(v.holds and max(v.loss_gap, v.weight_gap) <= 1e-5 for v in verdicts), table(verdicts)


@pytest.mark.slow
def test_topk_holds_deepseek_to_k_per_bucket_beside_its_router_bias_traffic(tmp_path):
    """Beside its gradient, a DeepSeek step sends its own traffic (DDP's broadcast of the loss-free router bias,
    the all-reduce of tokens per expert): top-k keeps it and sends at most k values and indices per bucket."""
    verdict = topk_bytes(Matrix(tmp_path, echo=lambda _: None, family="deepseek"), 2)
    assert verdict.holds, table([verdict])
    # 3 MoE layers x 4 experts in fp32: 48 B of bias broadcast by rank 0, 48 B of loads all-reduced by each rank
    assert "plain DDP's besides its all-reduce [144, " in verdict.measured, verdict.measured
