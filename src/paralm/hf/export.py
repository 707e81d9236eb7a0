"""`paralm export` and `paralm import`: a run's model as a Hugging Face folder, and back.

Export reads the run's checkpoint through DCP, which gathers any layout (DDP, ZeRO-3, TP, PP) into
one process's unsharded model, and writes `config.json`, `model.safetensors` (or shards and their index,
`paralm.hf.shards`) and a `tokenizer.json` that `transformers.AutoModelForCausalLM` / `AutoTokenizer`
load. Import turns such a folder (one file or sharded, `paralm.models.hf_folder`; any model its family's
mapping computes exactly, `ModelSpec.hf`) into a run directory with a step-0 checkpoint, so `paralm train`
fine-tunes it; the folder's `tokenizer.json` and `tokenizer_config.json` (its chat template, its special
tokens) stay with the run's data and go back out on export. Both write into a temporary folder and
rename it when complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from paralm.config.load import load_config
from paralm.config.schema import CONFIG_FILE, ParallelConfig, SyncConfig
from paralm.data.corpus import default_corpus
from paralm.data.prepare import write_dataset
from paralm.data.shards import read_meta
from paralm.data.tokenizer import BPE_FILE, PretrainedTokenizer, load_tokenizer
from paralm.errors import UserError
from paralm.hf.shards import parse_size, write_weights
from paralm.models.config import ModelConfig, to_flat
from paralm.models.hf_folder import CONFIG_FILE as HF_CONFIG_FILE
from paralm.models.hf_folder import load_tensors, model_fields, read_folder
from paralm.models.registry import family_spec, model_shape, model_spec
from paralm.models.spec import ModelSpec, StateDict, retie, tied_parameters
from paralm.parallel.runtime import init_runtime
from paralm.runs import load_trained_model
from paralm.runs.quantized import refuse_quantized
from paralm.runs.write import atomic_folder, fresh_optimizer_state
from paralm.sync.base import SyncStrategy, TrainingState
from paralm.train.checkpoint.store import save_checkpoint, trainer_state

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others for
    characters from 256 up, so every byte is one visible character (what `tokenizers.ByteLevel` uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_tokenizer():
    """paralm's byte tokenizer as a `tokenizers.Tokenizer`: token id = byte value, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def hf_tokenizer(data_dir: Path):
    """The dataset's tokenizer as Hugging Face loads it (a `tokenizers.Tokenizer`), and its end-of-text
    and beginning-of-sequence tokens: lm-eval's `hf` model prefixes an empty context with one of them,
    so both are always defined. Where the tokenizer has none (bytes), the token of id 0 stands for them,
    marked special so that both sides split it alike."""
    meta = read_meta(data_dir)
    if meta["tokenizer"] == "byte":
        tokenizer, eos_id, bos_id = byte_tokenizer(), None, None
    else:
        loaded = load_tokenizer(meta["tokenizer"], data_dir)
        tokenizer, eos_id, bos_id = loaded.backend, loaded.eot_id, loaded.bos_id
    eos = tokenizer.id_to_token(0 if eos_id is None else eos_id)
    bos = eos if bos_id is None else tokenizer.id_to_token(bos_id)
    tokenizer.add_special_tokens(sorted({eos, bos}))
    return tokenizer, {"eos_token": eos, "bos_token": bos}


def transformers_tokenizer(data_dir: Path, **options):
    """The dataset's tokenizer as `paralm export` writes it, a transformers `PreTrainedTokenizerFast`, with
    the chat template kept with the data (if any)."""
    from transformers import PreTrainedTokenizerFast

    meta = read_meta(data_dir)
    template = getattr(load_tokenizer(meta["tokenizer"], data_dir), "chat_template", None)
    backend, specials = hf_tokenizer(data_dir)
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **specials, **options)


def _is_byte_tokenizer(path: Path) -> bool:
    """Whether a tokenizer file is paralm's byte tokenizer (every byte its own id, no merges)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab() == byte_tokenizer().get_vocab()


def export_run(run_dir: str, out: str, checkpoint: str | None = None, max_shard_size: str | None = None) -> str:
    """Write the run's model as a transformers folder of its family (sharded above `max_shard_size`, e.g.
    "5GB"); returns a one-line summary."""
    limit = parse_size(max_shard_size) if max_shard_size else None
    refuse_quantized(run_dir, "exported (transformers reads torchao weights only through its own TorchAoConfig)")
    loaded = load_trained_model(run_dir, checkpoint)
    model_config = loaded.config.model
    hf = model_spec(model_config).hf
    kwargs = hf.config_to_hf(model_config)
    meta = read_meta(loaded.data_dir)
    tokenizer, specials = hf_tokenizer(loaded.data_dir)
    eos_id = tokenizer.token_to_id(specials["eos_token"])
    bos_id = tokenizer.token_to_id(specials["bos_token"])
    hf_config = {  # the family's defaults, unless its config says which architecture these options make
        "architectures": [hf.architecture],
        "model_type": hf.model_type,
        **kwargs,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    weights = hf.to_hf(loaded.model.cpu().state_dict(), model_config)
    tokenizer_config = {
        **_imported_tokenizer_config(loaded.data_dir, meta["tokenizer"]),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_config.block_size,
        **specials,
    }
    out_dir = Path(out)
    with atomic_folder(out_dir) as tmp:
        files = write_weights(weights, tmp, limit)
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(hf_config, indent=1))
        tokenizer.save(str(tmp / BPE_FILE))
        (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config, indent=1))
    shards = f" in {files} shards" if files > 1 else ""
    return (
        f"{out_dir}: {hf_config['architectures'][0]} ({_millions(model_config)} parameters{shards}, "
        f"{meta['tokenizer']} tokenizer) "
        f"from {loaded.checkpoint}; load it with transformers.AutoModelForCausalLM.from_pretrained({str(out_dir)!r})"
    )


def _millions(model: ModelConfig) -> str:
    return f"{model_shape(model).flops_params / 1e6:.2f}M"


def _imported_tokenizer_config(data_dir: Path, tokenizer: str) -> dict:
    """The imported folder's own tokenizer_config.json (chat template, added tokens), kept with the data."""
    path = data_dir / TOKENIZER_CONFIG_FILE
    if tokenizer != "hf" or not path.is_file():
        return {}
    return json.loads(path.read_text())


def _data_overrides(hf_dir: Path, tmp: Path, out: Path, val_fraction: float) -> tuple[list[str], str]:
    """Config overrides for the data the model's tokenizer reads, and a sentence saying which."""
    path = hf_dir / BPE_FILE
    if not path.is_file():
        return ["--data.tokenizer=byte"], f"no {BPE_FILE} in {hf_dir}: the run reads byte tokens"
    tokenizer = PretrainedTokenizer.from_path(hf_dir)  # with its tokenizer_config's specials; or a one-line error
    if _is_byte_tokenizer(path):
        return ["--data.tokenizer=byte"], "byte tokenizer"
    write_dataset((text for _, text in default_corpus()), tmp / "data", tokenizer, val_fraction)
    if (hf_dir / TOKENIZER_CONFIG_FILE).is_file():  # kept whole: export gives it back
        shutil.copyfile(hf_dir / TOKENIZER_CONFIG_FILE, tmp / "data" / TOKENIZER_CONFIG_FILE)
    return [f"--data.path={out / 'data'}"], f"the model's tokenizer on the embedded corpus in {out / 'data'}"


def _model_of(spec: ModelSpec, config: ModelConfig, state: StateDict, source: str) -> torch.nn.Module:
    """The family's model holding `state`'s tensors themselves: built on the meta device and assigned the
    weights (ties restored), so the import holds one copy of the weights rather than a random one besides."""
    with torch.device("meta"):
        model = spec.build(config)
    tied = tied_parameters(model, spec)
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        raise UserError(f"{source}: {str(e).splitlines()[-1].strip()}") from None
    retie(model, tied)
    return model


def import_hf(hf_dir: str, out: str, config_path: str | None, overrides: list[str]) -> str:
    """Create a run directory whose step-0 checkpoint holds the HF model's weights; returns a summary."""
    hf_path, out_dir = Path(hf_dir), Path(out)
    folder = read_folder(hf_path)
    fields = model_fields(folder)
    spec = family_spec(fields["family"])
    model_args = [f"--model.{k}={v}" for k, v in fields.items()]
    with atomic_folder(out_dir) as tmp:
        base = load_config(config_path, [*model_args, f"--run.dir={out_dir}", *overrides])
        data_args, data_note = _data_overrides(hf_path, tmp, out_dir, base.data.val_fraction)
        config = load_config(config_path, [*model_args, f"--run.dir={out_dir}", *data_args, *overrides])
        resolved = to_flat(config.model)
        changed = [k for k, v in fields.items() if k != "dropout" and v != resolved[k]]
        if changed:
            raise UserError(f"model.{changed[0]} is fixed by the imported model's {HF_CONFIG_FILE}: do not override it")
        state = spec.hf.from_hf(load_tensors(folder), config.model, folder.source)  # the folder's dict is let go
        model = _model_of(spec, config.model, state, folder.source)
        optimizer = fresh_optimizer_state(model, config)
        runtime = init_runtime(ParallelConfig(), SyncConfig())
        state = trainer_state(0, 0, config.model.block_size, runtime.world_size)
        save_checkpoint(tmp, 0, TrainingState(model, optimizer, SyncStrategy()), state, config, runtime)
        (tmp / CONFIG_FILE).write_text(config.to_toml())
    return (
        f"{out_dir}: step-0 checkpoint of {hf_path} ({_millions(config.model)} parameters; {data_note}); "
        f"fine-tune with: paralm train --config {out_dir / CONFIG_FILE}"
    )
