"""paralm's model for lm-evaluation-harness (`lm_eval.api.model.LM`, through its `TemplateLM`).

It scores exactly what lm-eval's own `hf` model scores on the folder `paralm export` writes: the same
Hugging Face tokenizer (built from the same files), the same context/continuation split (TemplateLM's),
the same left truncation to `max_length + 1` tokens, the same rolling windows for perplexity, and (with
`apply_chat_template`) the same rendering of a task's prompts with the run's chat template. So
`paralm eval --tasks` and `lm_eval --model hf` agree on a run and its export.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from torch import nn

from paralm.errors import UserError
from paralm.models.sampling import generate


class ParalmLM(TemplateLM):
    """A trained paralm model on one process; `tokenizer` is a transformers fast tokenizer."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        block_size: int,
        device: torch.device,
        batch_size: int = 4,
        name: str = "paralm",
    ) -> None:
        super().__init__()
        self.model, self.tokenizer, self._device = model.eval(), tokenizer, device
        self.max_length, self.batch_size, self.name = block_size, batch_size, name

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        """What lm-eval keys its cache of chat-rendered requests by: the run."""
        return self.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The run's chat template (lm-eval records it with the results); none when not asked for."""
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """A task's (few-shot) messages as one prompt, rendered as lm-eval's `hf` model renders them: with
        the generation prompt, or else the last (assistant) message left open to continue; a template
        that rejects the system role gets the messages without it."""
        from jinja2 import TemplateError

        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": not add_generation_prompt}
        try:
            return self.tokenizer.apply_chat_template(chat_history, tokenize=False, **options)
        except TemplateError:
            others = [message for message in chat_history if message["role"] != "system"]
            return self.tokenizer.apply_chat_template(others, tokenize=False, **options)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As lm-eval's `hf` model: the tokenizer's own special tokens, unless the text starts with the prefix."""
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kwargs = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **kwargs)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Sum of the continuation's log-probabilities and whether greedy decoding gives it, per request."""
        results = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start : start + self.batch_size]
            inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in chunk]
            width = max(len(i) for i in inputs)
            padded = torch.zeros(len(inputs), width, dtype=torch.long)
            for row, tokens in enumerate(inputs):
                padded[row, : len(tokens)] = torch.tensor(tokens)
            logprobs = F.log_softmax(self.model(padded.to(self._device)).float(), dim=-1).cpu()
            for (_, _, cont), tokens, rows in zip(chunk, inputs, logprobs, strict=True):
                scored = rows[len(tokens) - len(cont) : len(tokens)]
                target = torch.tensor(cont, dtype=torch.long)
                greedy = bool((scored.argmax(dim=-1) == target).all())
                results.append((float(scored.gather(1, target[:, None]).sum()), greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in disjoint windows of `max_length` tokens, as lm-eval's `hf`."""
        totals = []
        for (string,) in (r.args for r in requests):
            windows = [
                (None, *utils.make_disjoint_window(w))
                for w in utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            totals.append(sum(logprob for logprob, _ in self._loglikelihood_tokens(windows)))
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, cut at the first stop string and the end-of-text token. The request's
        generation settings are read with lm-eval's own normalisation (`max_gen_toks` or its aliases
        `max_new_tokens`, `max_tokens`, `max_completion_tokens`; greedy unless `do_sample`), and a request
        that leaves the prompt no room is refused as the `hf` model refuses it."""
        outputs = []
        eos = self.tokenizer.decode([self.eot_token_id])
        for context, gen_kwargs in (r.args for r in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs)
            until = handle_stop_sequences(kwargs["until"], eos=eos)
            max_new = kwargs["max_gen_toks"]
            if max_new >= self.max_length:
                raise UserError(
                    f"the task asks for {max_new} generated tokens, not fewer than the model's context of "
                    f"{self.max_length} (model.block_size), as lm-eval's hf model refuses too: lower the task's "
                    "generation_kwargs max_gen_toks"
                )
            ids = self.tok_encode(context)[-(self.max_length - max_new) :]
            idx = torch.tensor([ids], dtype=torch.long, device=self._device)
            temperature = float(kwargs["temperature"]) if kwargs["do_sample"] else 0.0
            out = generate(self.model, idx, max_new, self.max_length, temperature=temperature)
            text = self.tokenizer.decode(out[0, len(ids) :].tolist())
            outputs.append(postprocess_generated_text(text, until, think_end_token=None))
        return outputs
