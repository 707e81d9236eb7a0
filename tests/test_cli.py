"""The CLI as a user meets it: verbs work, and every bad input is one line, exit code 2, no traceback."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from paralm.cli import main
from paralm.data.sampler import sample_windows
from paralm.data.shards import TokenDataset
from paralm.runs import load_trained_model
from paralm.train.checkpoint.integrity import write_manifest
from paralm.train.validation import EVAL_SEED_OFFSET

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--config",
    str(ROOT / "configs/tiny.toml"),
    "--model.n_layer=1",
    "--model.d_model=32",
    "--model.block_size=32",
    "--train.micro_batch_size=4",
    "--train.eval_samples=8",
    "--log.tensorboard=false",
]


def paralm(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paralm", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=os.environ.copy(),
        timeout=300,
    )


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    for fragment in fragments:
        assert fragment in output, output


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("cli") / "run"
    result = paralm("train", *TINY, f"--run.dir={run}", "--train.steps=4")
    assert result.returncode == 0, result.stderr
    return run


def test_train_writes_metrics_config_and_a_checkpoint(trained_run):
    assert (trained_run / "metrics.jsonl").read_text().count("\n") == 4
    assert (trained_run / "config.toml").is_file()
    assert (trained_run / "checkpoints" / "step_000004" / "trainer_state.json").is_file()


def test_eval_reports_loss_and_perplexity(trained_run):
    """The printed loss is the mean cross-entropy of the checkpoint on the validation windows, recomputed
    here from the model's logits (to the 4 printed decimals), and the perplexity is its exponential."""
    result = paralm("eval", "--run", str(trained_run))
    assert result.returncode == 0, result.stderr
    printed = re.search(r"val loss (\S+)  perplexity (\S+)  \(([\d,]+) tokens\)", result.stdout)
    assert printed, result.stdout
    loss, perplexity, tokens = float(printed[1]), float(printed[2]), int(printed[3].replace(",", ""))

    loaded = load_trained_model(trained_run)
    t = loaded.config.train
    dataset = TokenDataset(loaded.data_dir, "val", loaded.config.model.block_size)
    windows = sample_windows(t.seed + EVAL_SEED_OFFSET, 0, t.eval_samples, dataset.num_windows)
    x, y = dataset.batch(windows)
    with torch.no_grad():
        logits = loaded.model(x)
    expected = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert tokens == y.numel() == 8 * 32
    assert loss == pytest.approx(expected, abs=5e-5)
    assert perplexity == pytest.approx(math.exp(expected), abs=0.005 + math.exp(expected) * 5e-5)
    assert 1 < perplexity < 256  # better than uniform over the byte vocabulary, after 4 steps


def test_generate_continues_the_prompt(trained_run):
    result = paralm(
        "generate", "--run", str(trained_run), "--prompt", "def ", "--max-new-tokens", "20", "--temperature", "0"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ") and len(result.stdout) > len("def ")


def test_data_prepare_then_train_on_it(tmp_path):
    (tmp_path / "doc.txt").write_text("Some text to learn from. " * 200)
    result = paralm("data", "prepare", "--input", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "ds"))
    assert result.returncode == 0 and "train" in result.stdout, result.stderr
    result = paralm(
        "train", *TINY, f"--data.path={tmp_path / 'ds'}", f"--run.dir={tmp_path / 'run'}", "--train.steps=1"
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["train", "--train.no_such_field=1"], ["train.no_such_field"]),
        (["train", "--train.steps=abc"], ["train.steps", "integer"]),
        (["train", "--config", "missing.toml"], ["missing.toml"]),
        (["train", "--data.path=/no/such/data"], ["data.path", "/no/such/data"]),
        (["train", "--nproc", "3", "--parallel.dp=2"], ["parallel", "3 ranks"]),
        (["train", "--parallel.zero=7"], ["parallel.zero"]),
        (["eval", "--run", "/no/such/run"], ["/no/such/run"]),
        (["data", "prepare", "--input", "/no/such.txt", "--out", "x"], ["/no/such.txt"]),
    ],
)
def test_bad_input_is_one_clear_line(args, fragments, tmp_path):
    assert_user_error(paralm(*args, cwd=tmp_path), *fragments)


def test_incompatible_or_corrupt_checkpoints_are_user_errors(trained_run, tmp_path):
    wider = paralm("train", *TINY, f"--run.dir={trained_run}", "--model.d_model=64", "--train.steps=5")
    assert_user_error(wider, "model.d_model")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ".metadata").write_bytes(b"garbage")
    (broken / "trainer_state.json").write_text('{"step": 1, "samples_seen": 4}')
    (broken / "config.toml").write_text((trained_run / "config.toml").read_text())
    resumed = paralm("train", *TINY, f"--run.dir={tmp_path / 'new'}", f"--checkpoint.resume={broken}")
    assert_user_error(resumed, str(broken))
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_checkpoint_metadata_that_would_run_code_is_refused(trained_run, tmp_path):
    import pickle
    import shutil

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    ckpt = tmp_path / "evil"
    shutil.copytree(trained_run / "checkpoints" / "step_000004", ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    write_manifest(ckpt)  # a matching manifest: the unpickler itself must refuse
    assert_user_error(paralm("eval", "--run", str(trained_run), "--checkpoint", str(ckpt)), "does not load")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_nproc_2_trains_data_parallel(tmp_path):
    result = paralm("train", *TINY, "--nproc", "2", f"--run.dir={tmp_path / 'ddp'}", "--train.steps=2")
    assert result.returncode == 0, result.stderr
    assert "2 rank(s)" in result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--nproc", "0"],
        ["train", "--max-restarts", "-1"],
        ["train", "--nproc", "two"],
        ["generate", "--run", "r", "--max-new-tokens", "-1"],
        ["generate", "--run", "r", "--temperature", "-0.5"],
        ["generate", "--run", "r", "--top-k", "-3"],
        ["data", "prepare", "--input", "a", "--out", "b", "--val-fraction", "1"],
        ["data", "prepare", "--input", "a", "--out", "b", "--vocab-size", "100"],
    ],
)
def test_every_argument_out_of_range_is_one_line_and_exit_2(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own type errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("paralm")


@pytest.mark.slow
def test_a_user_error_inside_the_workers_is_printed_once_with_exit_2(trained_run, tmp_path):
    checkpoint = trained_run / "checkpoints" / "step_000004"
    result = paralm(
        "train", *TINY, "--model.d_model=16", "--nproc", "2", f"--run.dir={tmp_path / 'r'}",
        f"--checkpoint.resume={checkpoint}", "--train.steps=6",
    )  # fmt: skip
    assert_user_error(result, "holds a different model")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_export_help_names_every_architecture_the_families_map_to(capsys):
    """`paralm --help`'s export line names each Hugging Face `model_type` a family exports or imports."""
    from paralm.models.registry import FAMILIES

    with pytest.raises(SystemExit):
        main(["--help"])
    text = "".join(capsys.readouterr().out.split()).lower().replace("-", "")
    export = text[text.index("export") :]
    types = [t for spec in FAMILIES.values() for t in (spec.hf.model_type, *spec.hf.related)]
    assert [t for t in types if t.replace("_", "") not in export] == []
