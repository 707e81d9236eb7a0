import dataclasses

import pytest

from paralm.config.degrees import resolve_data_parallel
from paralm.config.dims import ParallelDims
from paralm.config.load import load_config
from paralm.config.rules import microbatch_problem, validate
from paralm.errors import UserError
from paralm.plan.cluster import parse_cluster
from paralm.plan.layout import Workload
from paralm.plan.request import load_request
from paralm.plan.search import evaluate, search
from tests.plan.helpers import MODEL_7B


def _search(overrides: list[str], cluster: str = "h200:64"):
    config, fixed = load_request(None, overrides)
    return config, search(config, parse_cluster(cluster), fixed)[1]


def test_fixed_fields_come_from_the_command_line_only(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\ntp = 2\n[train]\nmicro_batch_size = 4\n")
    config, fixed = load_request(path, ["--parallel.zero=3", "--model.n_layer=2"])
    assert fixed == {"parallel.zero": 3}
    assert config.parallel.tp == 2 and config.train.micro_batch_size == 4  # the file's values, not fixed


def test_fixed_fields_are_kept_and_the_rest_searched() -> None:
    _, plans = _search([*MODEL_7B, "--parallel.tp=2", "--parallel.zero=2"])
    assert {(p.layout.tp, p.layout.zero) for p in plans} == {(2, 2)}
    assert len({(p.layout.pp, p.layout.micro_batch_size) for p in plans}) > 1


def test_a_fixed_zero_stage_shards_over_the_whole_group_and_an_open_one_tries_hybrids() -> None:
    _, fixed = _search([*MODEL_7B, "--parallel.zero=3", "--parallel.pp=1", "--parallel.tp=1", "--parallel.cp=1"])
    assert {(p.layout.dp_replicate, p.layout.dp_shard) for p in fixed} == {(1, 64)}
    _, open_ = _search([*MODEL_7B, "--parallel.pp=1", "--parallel.tp=1"])
    assert any(p.layout.dp_replicate > 1 and p.layout.zero == 3 for p in open_)


@pytest.mark.parametrize(
    "given,expected",
    [("--parallel.dp_replicate=2", {(2, 32)}), ("--parallel.dp_shard=-1", {(1, 64)}), ("--parallel.dp_shard=8", set())],
)
def test_hybrid_degrees_resolve_as_paralm_does(given: str, expected: set) -> None:
    """-1 takes the remainder and an unset degree keeps its default (dp_replicate 1), as in `ParallelDims`."""
    overrides = [*MODEL_7B, "--parallel.tp=1", "--parallel.pp=1", "--parallel.cp=1", given]
    if expected:
        assert {(p.layout.dp_replicate, p.layout.dp_shard) for p in _search(overrides)[1]} == expected
    else:  # dp_shard = 8 with dp_replicate = 1 is 8 ranks, not 64
        with pytest.raises(UserError, match="no layout of 64 devices matches"):
            _search(overrides)


def test_plans_are_ranked_by_throughput_and_all_fit() -> None:
    config, plans = _search(MODEL_7B)
    cluster = parse_cluster("h200:64")
    speeds = [p.tokens_per_s for p in plans]
    assert speeds == sorted(speeds, reverse=True)
    assert all(p.memory.total <= cluster.memory_bytes for p in plans)
    assert all(
        p.layout.devices == 64 and p.layout.dp * p.layout.micro_batch_size * p.layout.grad_accum == 64 for p in plans
    )
    best = plans[0]
    work = Workload.from_config(config, 64, "fp32-master")
    assert evaluate(best.layout, work, cluster).tokens_per_s == best.tokens_per_s


def test_every_layout_is_a_config_paralm_accepts(tmp_path) -> None:
    """Each proposed layout, written out, passes paralm's own validation (`load_config`)."""
    _, plans = _search([*MODEL_7B, "--train.global_batch_size=128"])
    config = load_config(None, MODEL_7B)
    assert {p.layout.zero for p in plans if p.layout.tp * p.layout.pp > 1} <= {0, 2, 3}  # no ZeRO-1 with tp/pp
    path = tmp_path / "layout.toml"
    for plan in plans[:: max(1, len(plans) // 12)]:
        path.write_text(plan.layout.apply_to(config).to_toml())
        load_config(path)
    path.write_text(plans[0].layout.apply_to(config).to_toml())
    written = load_config(path)
    dims = ParallelDims.from_config(written.parallel, written.sync, 64)
    lay = plans[0].layout
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (lay.pp, lay.dp_replicate, lay.dp_shard, lay.tp)
    assert written.train.micro_batch_size * written.train.grad_accum * dims.dp == 128


def test_every_plan_passes_paralms_rules() -> None:
    """The search has no rules of its own: every layout it proposes passes `paralm.config.rules` whole."""
    config, plans = _search([*MODEL_7B, "--train.global_batch_size=128"])
    assert {p.layout.pp for p in plans} > {1} and {p.layout.tp for p in plans} > {1}
    for plan in plans:
        candidate = plan.layout.apply_to(config)
        validate(candidate)
        resolve_data_parallel(candidate.parallel, 64)


def test_pipeline_micro_batch_counts_are_exactly_those_the_rules_accept() -> None:
    fixed = ["--parallel.pp=4", "--parallel.pp_schedule=1f1b", "--parallel.tp=1", "--parallel.zero=0"]
    config, plans = _search(["--model.n_layer=8", "--train.global_batch_size=64", *fixed], cluster="h200:16")
    proposed = {p.layout.pp_microbatches for p in plans}
    accepted = {
        n
        for n in range(1, 17)
        if 16 % n == 0
        and not microbatch_problem(
            dataclasses.replace(plans[0].layout, pp_microbatches=n, micro_batch_size=16).apply_to(config)
        )
    }
    assert proposed == accepted == {4, 8, 16}  # 1F1B: one micro-batch per rank at least


@pytest.mark.parametrize(
    "overrides,refused",
    [
        (["--precision.dtype=fp16"], lambda lay: lay.pp > 1),  # no loss scaling in the pipeline schedules
        (["--precision.reduce_dtype=bf16"], lambda lay: lay.zero < 2),  # only FSDP reduces in another dtype
        (["--model.vocab_size=51203"], lambda lay: lay.tp > 1),  # 51203 is prime: no vocabulary shards
    ],
)
def test_what_the_rules_refuse_is_never_proposed(overrides: list[str], refused) -> None:
    _, plans = _search([*MODEL_7B, *overrides])
    assert plans and not any(refused(p.layout) for p in plans)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--parallel.tp=3"], "n_head"),
        (["--parallel.pp=37"], "n_layer"),
        (["--train.global_batch_size=3", "--parallel.tp=1", "--parallel.pp=1", "--parallel.cp=1"], "no layout"),
    ],
)
def test_impossible_requests_are_user_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        _search([*MODEL_7B, *overrides])


def test_a_model_too_big_for_the_cluster_says_how_much_it_needs() -> None:
    with pytest.raises(UserError, match=r"no layout fits: the smallest needs [\d.]+ GiB"):
        _search(MODEL_7B, cluster="a100-40gb:1")


@pytest.mark.parametrize(
    "sync",
    [
        ["--sync.mode=parameter_server", "--train.global_batch_size=126"],  # 1 server, 63 workers
        ["--sync.mode=local_sgd", "--checkpoint.every=8"],
        ["--comm.compression=fp16"],
    ],
)
def test_whole_model_strategies_replicate(sync: list[str]) -> None:
    _, plans = _search([*MODEL_7B, *sync])
    assert {(p.layout.zero, p.layout.tp, p.layout.pp) for p in plans} == {(0, 1, 1)}


def test_activation_checkpointing_only_when_needed() -> None:
    """No recompute when memory allows: it only costs time."""
    _, roomy = _search(MODEL_7B)
    assert roomy[0].layout.activation_checkpointing == "none"
    _, tight = _search(
        [*MODEL_7B, "--parallel.zero=0", "--parallel.tp=1", "--parallel.pp=1", "--train.global_batch_size=512"],
        cluster="h200:64",
    )
    assert {p.layout.activation_checkpointing for p in tight} - {"none"}
