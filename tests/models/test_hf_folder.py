"""A Hugging Face folder's `config.json` that describes no model paralm can build is refused in one line naming
the file and the field, by `paralm import` and `checkpoint.init_from` alike, before any tensor is read: a size
that is not a positive integer by its config.json name, a shape the family refuses by its `[model]` name.
(The folder's other checks: `tests/hf/test_pretrained.py`.)
"""

import json

import pytest
import torch

from paralm.cli import main
from tests.hf_helpers import assert_import_refused

transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "changes, fragment",
    [
        # without head_dim the mapping divides hidden_size by num_attention_heads
        ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads = 0 must be a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers = 0 must be a positive integer"),
        ({"hidden_size": "32"}, "hidden_size = '32' must be a positive integer"),
        # transformers' head width when head_dim is absent (44 // 5), which paralm's Llama cannot take
        ({"hidden_size": 44, "num_attention_heads": 5, "head_dim": None}, "model.d_model = 44 must be divisible"),
    ],
    ids=["zero-heads", "zero-layers", "text-width", "heads-do-not-divide"],
)
def test_a_config_json_paralm_cannot_build_is_refused_naming_it(tmp_path, capsys, changes, fragment):
    hf = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(hf)
    config = json.loads((hf / "config.json").read_text()) | changes
    (hf / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    expected = f"{hf / 'config.json'}: {fragment}"
    assert_import_refused(hf, tmp_path / "run", capsys, expected)
    assert main(["train", f"--checkpoint.init_from={hf}", f"--run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
