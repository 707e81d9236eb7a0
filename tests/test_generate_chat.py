"""`paralm generate --chat`: the prompt as one user turn of the run's chat template, only the reply printed,
ended at the template's end of turn; a run whose tokenizer has no template is a one-line error."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from paralm.cli import main
from paralm.models.sampling import generate
from paralm.runs import load_trained_model
from tests.chat_helpers import chat_run


@pytest.mark.slow
def test_generate_chat_prints_the_reply_up_to_the_end_of_turn(tmp_path_factory, capsys):
    run, _, tokenizer_dir = chat_run(tmp_path_factory.mktemp("chat_run"))
    prompt = "model trains on data"
    argv = ["generate", "--run", str(run), "--chat", "--prompt", prompt, "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", "40"]) == 0
    reply = capsys.readouterr().out.removesuffix("\n")

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = hf(text, add_special_tokens=False)["input_ids"]
    loaded = load_trained_model(str(run))
    out = generate(loaded.model, torch.tensor([ids]), 40, 64, temperature=0)[0, len(ids) :].tolist()
    end = hf.convert_tokens_to_ids("<|im_end|>")
    assert end in out  # the trained model ends its turn: the reply stops there
    assert reply == hf.decode(out[: out.index(end)]) and reply.strip() and "<|im" not in reply

    config = run.parent / "data" / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    assert main([*argv, "--max-new-tokens", "4"]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "has no chat template" in error and "drop --chat" in error
