"""`paralm export --adapters-only`: a LoRA run's adapters as a PEFT folder; peft loads them onto the exported
base and gives the logits of paralm's merged model (GPT-2's fused q, k, v included, with a layer left out).

Tolerance: the merged weight W + s B A rounds differently from PEFT's W x + s B (A x): 1e-4 on logits of order 1.
"""

import json

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from paralm.cli import main
from paralm.job import train
from paralm.runs import load_trained_model
from tests.helpers import tiny_config

LLAMA = {"family": "llama", "n_kv_heads": 1, "ffn_hidden": 64}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, targets", [({}, ["wq", "wv", "fc"]), (LLAMA, [])], ids=["gpt2-fused-qkv-partial", "llama-every-layer"]
)
def test_peft_loads_the_adapters_onto_the_exported_base(tmp_path, model, targets):
    base = tiny_config(tmp_path / "base", model=model, train={"steps": 2})
    train(base)
    lora = {"steps": 3, "lr": 3e-2, "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": targets}
    train(tiny_config(tmp_path / "lora", model=model, train=lora, checkpoint={"init_from": str(base.run.dir)}))
    assert main(["export", "--run", str(base.run.dir), "--out", str(tmp_path / "base_hf")]) == 0
    adapters = tmp_path / "adapters"
    assert main(["export", "--run", str(tmp_path / "lora"), "--out", str(adapters), "--adapters-only"]) == 0
    assert json.loads((adapters / "adapter_config.json").read_text())["peft_type"] == "LORA"

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base_hf", dtype=torch.float32).eval()
    ids = torch.randint(0, base.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = hf(ids).logits
        adapted = peft.PeftModel.from_pretrained(hf, adapters).eval()(ids).logits
        merged = load_trained_model(tmp_path / "lora").model.float()(ids)
    assert (adapted - merged).abs().max() <= 1e-4
    assert (plain - merged).abs().max() > 1e-3  # the adapters trained: the check sees them


def test_adapters_only_needs_a_lora_run(tmp_path, capsys):
    config = tiny_config(tmp_path / "run", train={"steps": 1})
    train(config)
    assert main(["export", "--run", str(config.run.dir), "--out", str(tmp_path / "a"), "--adapters-only"]) == 2
    assert "trained no LoRA adapters" in capsys.readouterr().err and not (tmp_path / "a").exists()
