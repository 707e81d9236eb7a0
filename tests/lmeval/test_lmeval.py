"""`paralm eval --tasks` scores what lm-eval's own `hf` model scores on the run's `paralm export`."""

import json
import math
import os
import shlex
import subprocess

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from paralm.cli import main
from paralm.data.prepare import prepare_dataset
from paralm.errors import UserError
from paralm.hf.export import export_run
from paralm.job import train
from paralm.lmeval.run import paralm_lm
from tests.helpers import tiny_config

TOPICS = sorted(__import__("pydoc_data.topics", fromlist=["topics"]).topics.items())
BLOCK = 32
LM_EVAL_COMMAND = (  # as docs/evaluation.md shows it (device=cpu inside --model_args crashes lm-eval 0.4.13)
    "lm_eval --model hf --model_args pretrained={exported},dtype=float32 --tasks local_mc "
    "--include_path {tasks} --device cpu --batch_size 4 --output_path {out}"
)


_RUNS = {}


@pytest.fixture(scope="module", params=["byte", "tokenizer.json"])
def run(request, tmp_path_factory):
    return _trained(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    return _trained("tokenizer.json", tmp_path_factory)


def _trained(kind, tmp_path_factory):
    """A few steps of a tiny model (2 checkpoints) on a byte dataset or one with a pretrained-style BPE,
    and its export; made once per module and kind."""
    if kind in _RUNS:
        return _RUNS[kind]
    tmp = tmp_path_factory.mktemp(kind.replace(".", "_"))
    (tmp / "corpus.txt").write_text("".join(text for _, text in TOPICS[:30]))
    tokenizer = "byte"
    if kind != "byte":
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, special_tokens=["<|endoftext|>"])
        bpe.train_from_iterator([t for _, t in TOPICS], trainer)
        bpe.save(str(tmp / "tok.json"))
        tokenizer = str(tmp / "tok.json")
    prepare_dataset([str(tmp / "corpus.txt")], str(tmp / "data"), tokenizer, 0, 0.1)
    run_dir = tmp / "run"
    train_config = {"steps": 3, "lr": 1e-2, "warmup_steps": 0}
    model = {"block_size": BLOCK, "vocab_size": 512}
    train(
        tiny_config(run_dir, data={"path": str(tmp / "data")}, model=model, train=train_config, checkpoint={"every": 2})
    )
    export_run(str(run_dir), str(tmp / "hf"))
    _RUNS[kind] = run_dir, tmp / "hf"
    return _RUNS[kind]


def _requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_the_adapter_scores_as_lm_eval_hf_model(run):
    run_dir, exported = run
    mine, _ = paralm_lm(str(run_dir), None, batch_size=3)
    theirs = HFLM(pretrained=str(exported), dtype="float32", device="cpu", batch_size=3)
    long = TOPICS[40][1][:400]
    pairs = [
        ("The keyword ", "def"),  # a trailing space moves to the continuation
        ("", "lambda x: x"),  # an empty context: the prefix token stands in
        (long, " and so on"),  # longer than the context window: truncated on the left
        ("Python", "\u0100 special?"),
        ("x = ", "1"),
    ]
    a = mine.loglikelihood(_requests("loglikelihood", pairs))
    b = theirs.loglikelihood(_requests("loglikelihood", pairs))
    assert [g for _, g in a] == [g for _, g in b]
    for (x, _), (y, _) in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-4
    texts = [(long,), (TOPICS[41][1][:150],)]  # several disjoint windows each
    for x, y in zip(
        mine.loglikelihood_rolling(_requests("loglikelihood_rolling", texts)),
        theirs.loglikelihood_rolling(_requests("loglikelihood_rolling", texts)),
        strict=True,
    ):
        assert abs(x - y) <= 1e-4
    until = _requests("generate_until", [("def f(", {"until": ["\n"], "max_gen_toks": 8})])
    assert mine.generate_until(until) == theirs.generate_until(until)
    # lm-eval's other names for the length (normalised by its own helper), a stop string alone, no max_gen_toks
    aliases = [("def f(", {"until": ["\n"], "max_new_tokens": 5}), ("x = ", {"until": ")", "max_tokens": 6})]
    aliases.append(("if ", {"until": ["\n"], "max_completion_tokens": 7, "do_sample": False, "temperature": 0.5}))
    assert mine.generate_until(_requests("generate_until", aliases)) == theirs.generate_until(
        _requests("generate_until", aliases)
    )
    default = _requests("generate_until", [("def f(", {"until": ["\n"]})])  # 256 new tokens: no room for a prompt
    with pytest.raises(AssertionError, match="must be less than"):
        theirs.generate_until(default)
    with pytest.raises(UserError, match="generated tokens, not fewer than the model's context"):
        mine.generate_until(default)


def _tasks(tmp):
    mc = [{"q": f"{name} is about", "choices": [name, "nothing", "lambda"], "answer": 0} for name, _ in TOPICS[:12]]
    (tmp / "mc.jsonl").write_text("\n".join(json.dumps(d) for d in mc))
    (tmp / "ppl.jsonl").write_text("\n".join(json.dumps({"text": t[:200]}) for _, t in TOPICS[50:54]))
    (tmp / "tasks").mkdir()
    data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tmp / "tasks" / "mc.yaml").write_text(
        "task: local_mc\n" + data.format(tmp / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (tmp / "tasks" / "ppl.yaml").write_text(
        "task: local_ppl\n" + data.format(tmp / "ppl.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )


@pytest.mark.slow
def test_paralm_eval_tasks_equal_lm_eval_on_the_export_at_every_checkpoint(bpe_run, tmp_path, capfd, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    run_dir, exported = bpe_run
    _tasks(tmp_path)
    out = tmp_path / "mine.json"
    monkeypatch.chdir(tmp_path)  # not a git checkout: lm-eval's `git describe` must not reach the terminal
    args = ["eval", "--run", str(run_dir), "--tasks", "local_mc,local_ppl", "--include-path", str(tmp_path / "tasks")]
    assert main([*args, "--out", str(out), "--every-checkpoint"]) == 0
    assert "not a git repository" not in capfd.readouterr().err
    mine = json.loads(out.read_text())["checkpoints"]
    assert [c["step"] for c in mine] == [2, 3]
    assert out.with_suffix(".png").stat().st_size > 0
    ref = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={exported},dtype=float32", tasks=["local_mc", "local_ppl"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")), device="cpu", batch_size=4,
    )["results"]  # fmt: skip
    for task, metric in [("local_mc", "acc,none"), ("local_mc", "acc_norm,none"), ("local_ppl", "word_perplexity,none"),
                         ("local_ppl", "bits_per_byte,none")]:  # fmt: skip
        assert abs(mine[-1]["results"][task][metric] - ref[task][metric]) <= 1e-4
    # the lm_eval command docs/evaluation.md shows for an exported folder gives the same figures
    command = LM_EVAL_COMMAND.format(exported=exported, tasks=tmp_path / "tasks", out=tmp_path / "cli")
    subprocess.run(shlex.split(command), check=True, capture_output=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    cli = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())["results"]
    assert abs(cli["local_mc"]["acc,none"] - ref["local_mc"]["acc,none"]) <= 1e-4


def test_an_unknown_task_or_include_path_is_a_one_line_error(bpe_run, tmp_path, capsys):
    run_dir, _ = bpe_run
    for args, fragment in (
        (["--tasks", "no_such_task"], "does not exist"),
        (["--tasks", "x", "--include-path", str(tmp_path / "nope")], "does not exist"),
        (["--out", str(tmp_path / "x.json")], "add --tasks"),  # a task option without tasks is not ignored
    ):
        assert main(["eval", "--run", str(run_dir), *args]) == 2
        assert fragment in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "x.json").exists()


def test_heldout_perplexity_is_the_exported_model_loss_on_the_file(run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, exported = run
    text = TOPICS[60][1][:300]
    (tmp_path / "held.txt").write_text(text)
    assert main(["eval", "--run", str(run_dir), "--heldout", str(tmp_path / "held.txt")]) == 0
    printed = capsys.readouterr().out
    loss = float(printed.split("val loss ")[1].split()[0])
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    ids = torch.tensor(AutoTokenizer.from_pretrained(exported).encode(text))
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, BLOCK):
        x, y = ids[start : start + BLOCK], ids[start + 1 : start + BLOCK + 1]
        with torch.no_grad():
            logits = model(x[None, : len(y)]).logits[0]
        total += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        count += len(y)
    assert abs(loss - total / count) < 1e-4 and math.isfinite(loss)


def _chat_task(tmp):
    """Yes/no questions as the chat run was trained on them (a reply says whether " model" is asked about)."""
    asks = ["the model trains", "data on many ranks", "a loss step", "with model parallel", "tensor batch"]
    docs = [{"q": q, "choices": ["no", "yes"], "answer": int(" model" in f" {q}")} for q in asks]
    (tmp / "chat.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (tmp / "chat_tasks").mkdir()
    (tmp / "chat_tasks" / "chat.yaml").write_text(
        f"task: local_chat\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp / 'chat.jsonl'}\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n'
    )
    return tmp / "chat_tasks"


@pytest.mark.slow
def test_the_chat_template_is_applied_as_lm_eval_hf_model_applies_it(tmp_path_factory, tmp_path, bpe_run, capsys):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tests.chat_helpers import chat_run

    run_dir, exported, _ = chat_run(tmp_path_factory.mktemp("chat_run"))
    mine, _ = paralm_lm(str(run_dir), None, batch_size=4)
    theirs = HFLM(pretrained=str(exported), dtype="float32", device="cpu", batch_size=4)
    assert mine.chat_template(True) == theirs.chat_template(True) and "<|im_start|>" in mine.chat_template(True)
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the model"}]
    for messages, prompt in ((history, True), ([*history, {"role": "assistant", "content": "ye"}], False)):
        assert mine.apply_chat_template(messages, prompt) == theirs.apply_chat_template(messages, prompt)

    manager = TaskManager(include_path=str(_chat_task(tmp_path)))
    scored = [
        lm_eval.simple_evaluate(model=lm, tasks=["local_chat"], task_manager=manager, apply_chat_template=True)
        for lm in (mine, theirs)
    ]
    samples = [s["samples"]["local_chat"] for s in scored]
    for a, b in zip(*samples, strict=True):
        assert a["arguments"] == b["arguments"] and a["arguments"][0][0].startswith("<|im_start|>user\n")
        for (x, _), (y, _) in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
            assert abs(x - y) <= 1e-4
    assert scored[0]["results"]["local_chat"]["acc,none"] == scored[1]["results"]["local_chat"]["acc,none"]

    args = ["eval", "--run", str(bpe_run[0]), "--tasks", "local_chat", "--include-path", str(tmp_path / "chat_tasks")]
    assert main([*args, "--apply-chat-template"]) == 2
    assert "has no chat template" in capsys.readouterr().err.strip().splitlines()[-1]
