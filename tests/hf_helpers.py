"""What the export/import tests of every family share: `paralm export` and `paralm import` through the CLI,
a run's logits against a transformers folder's, and the checks each family's export and import must pass.

Tolerance: paralm's model and its transformers counterpart run the same fp32 operations (GPT-2's Conv1D is
addmm on the transposed weight; Llama's RoPE is the same `rotate_half` rotation), so logits agree to
rounding, ~1e-6; we allow 1e-4 as the export issue states. Weights move without arithmetic, so an import of
an export is bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paralm.cli import main
from paralm.config.load import load_config
from paralm.generate import generate_from_run
from paralm.runs import load_trained_model
from paralm.sync.base import SyncStrategy, TrainingState
from paralm.train.checkpoint.store import latest_checkpoint, load_checkpoint
from paralm.train.optim.build import build_optimizer
from tests.helpers import read_metrics

LOGIT_TOLERANCE = 1e-4  # see the module docstring
EXPORTED_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def export(run_dir: Path, out: Path) -> None:
    assert main(["export", "--run", str(run_dir), "--out", str(out)]) == 0


def assert_same_logits(run_dir: Path, hf_dir: Path) -> None:
    """The run's latest checkpoint, loaded on one process, computes the logits the folder's model does."""
    import transformers

    ours = load_trained_model(run_dir).model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    x = torch.randint(
        0, ours.config.vocab_size, (2, ours.config.block_size), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        diff = (theirs(x).logits - ours(x)).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, diff


def assert_byte_tokenizer_and_greedy_text(run_dir: Path, hf_dir: Path) -> None:
    """`AutoTokenizer` reads the exported byte tokenizer as bytes, and transformers' greedy `generate` (with
    its own KV cache) writes the text `paralm generate` does."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = "déf f(x):\n\treturn x ≥ 0"
    assert tokenizer(text)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    prompt = "The "
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours = generate_from_run(str(run_dir), prompt, max_new_tokens=12, temperature=0, top_k=0)
    assert tokenizer.decode(greedy[0].tolist()) == ours


def import_hf(hf_dir: Path, out: Path, *overrides: str) -> None:
    assert main(["import", "--hf", str(hf_dir), "--out", str(out), "--log.tensorboard=false", *overrides]) == 0


def assert_import_is_the_same_model_and_fine_tunes(run_dir: Path, hf_dir: Path, out: Path) -> None:
    """`paralm import` of the run's export gives the run's model, bit for bit (so the folder's logits), with
    a fresh optimizer, and `paralm train` fine-tunes it."""
    import_hf(hf_dir, out, "--train.steps=3")
    assert_same_logits(out, hf_dir)
    original, imported = load_trained_model(run_dir), load_trained_model(out)
    assert imported.config.model == original.config.model
    for (name, a), b in zip(original.model.state_dict().items(), imported.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    config = load_config(out / "config.toml")
    optimizer = build_optimizer(imported.model, config.train)
    load_checkpoint(latest_checkpoint(out), TrainingState(imported.model, optimizer, SyncStrategy()))
    assert config.train.optimizer == "adamw"
    assert len(optimizer.state) == len(list(imported.model.parameters()))
    assert all(state["step"].item() == 0 for state in optimizer.state.values())  # AdamW starts afresh

    assert main(["train", "--config", str(out / "config.toml"), f"--run.dir={out}"]) == 0
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]
    assert latest_checkpoint(out).name == "step_000003"


def assert_a_saved_model_imports_with_the_same_logits_and_trains(hf_dir: Path, out: Path) -> None:
    args = ["--train.steps=2", "--train.micro_batch_size=2", "--train.eval_samples=4"]
    import_hf(hf_dir, out, *args)
    assert_same_logits(out, hf_dir)
    assert main(["train", "--config", str(out / "config.toml")]) == 0
    assert len(read_metrics(out)) == 2


def save_random(path: Path, model_class: type, config_class: type, **config) -> None:
    """A freshly initialised transformers model of `config`, saved with `save_pretrained` (no download)."""
    torch.manual_seed(0)
    model_class(config_class(**config)).save_pretrained(path)


def assert_import_refused(hf_dir: Path, out: Path, capsys, fragment: str) -> None:
    """Exit code 2, one line naming what does not map, and nothing written beside `hf_dir` (`out`'s parent
    holds only `hf_dir`)."""
    capsys.readouterr()  # transformers' own output while saving
    assert main(["import", "--hf", str(hf_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err
    assert list(out.parent.iterdir()) == [hf_dir]  # nothing half-written
