"""`paralm generate`: continue a prompt with a trained run's model, or (`--chat`) answer it as a chat
model, with the run's tokenizer's own chat template."""

from __future__ import annotations

from pathlib import Path

import torch

from paralm.data.shards import read_meta
from paralm.data.tokenizer import load_tokenizer
from paralm.errors import UserError
from paralm.models.sampling import generate
from paralm.runs import load_trained_model


def generate_from_run(
    run_dir: str,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int = 0,
    checkpoint: str | None = None,
    use_cache: bool = True,
    chat: bool = False,
) -> str:
    """The prompt followed by `max_new_tokens` sampled tokens, decoded to text; with `chat`, only the reply
    to the prompt as one user turn, up to the template's end of turn."""
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise UserError("--max-new-tokens, --temperature and --top-k must not be negative")
    loaded = load_trained_model(run_dir, checkpoint)
    tokenizer = load_tokenizer(read_meta(loaded.data_dir)["tokenizer"], loaded.data_dir)
    template = ChatTemplate(loaded.data_dir) if chat else None
    ids = template.prompt(prompt) if template else tokenizer.encode(prompt)
    if not ids:
        raise UserError("--prompt is empty: give at least one character")
    generator = torch.Generator(device=loaded.device).manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.long, device=loaded.device)
    block_size = loaded.config.model.block_size
    stop = template.stop if template else None
    out = generate(
        loaded.model, idx, max_new_tokens, block_size, temperature, top_k or None, generator, use_cache, stop
    )[0].tolist()
    if template is None:
        return tokenizer.decode(out)
    reply = out[len(ids) :]
    ends = [i for i, token in enumerate(reply) if token in template.stop]
    return tokenizer.decode(reply[: ends[0]] if ends else reply)


class ChatTemplate:
    """The chat template kept with a run's data (from its tokenizer folder's `tokenizer_config.json`), through
    transformers' template engine, and the tokens that end a reply: the end of text and the special token
    the template puts right after an assistant's turn (e.g. `<|im_end|>`, `<|eot_id|>`)."""

    def __init__(self, data_dir: Path, option: str = "--chat", instead: str = "drop --chat") -> None:
        """`option` (what asked for the template: a flag, a config field) and `instead` (the other way out)
        word the errors."""
        from paralm.hf.export import transformers_tokenizer

        self.option = option
        self.tokenizer = transformers_tokenizer(data_dir)
        if not self.tokenizer.chat_template:
            raise UserError(
                f"{option}: the run's tokenizer ({data_dir}) has no chat template: train on data prepared with a "
                f"tokenizer folder whose tokenizer_config.json has a chat_template, or {instead}"
            )
        self.stop = sorted({self.tokenizer.eos_token_id, *self._end_of_turn()})

    def render(self, messages: list[dict], generation_prompt: bool = True) -> str:
        """The conversation as text, by default followed by the generation prompt (the reply's turn opened)."""
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except TemplateError as e:
            raise UserError(
                f"{self.option}: the run's chat template fails on the conversation ({e}): fix its template"
            ) from None

    def encode(self, text: str) -> list[int]:
        """Rendered text as tokens, as `data prepare --chat` tokenizes it (the template wrote the specials)."""
        return self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def prompt(self, text: str) -> list[int]:
        """`text` as one user turn and the generation prompt, tokenized."""
        return self.encode(self.render([{"role": "user", "content": text}]))

    def _end_of_turn(self) -> list[int]:
        """The special token the template writes right after an assistant's reply, if it writes one."""
        marker = "\x00reply\x00"
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        after = self.render(turns, generation_prompt=False).partition(marker)[2]
        ids = self.encode(after)
        specials = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special
        }
        return ids[:1] if ids and ids[0] in specials else []
