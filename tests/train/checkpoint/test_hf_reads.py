"""`checkpoint.init_from` from a Hugging Face folder reads, on each rank, only the slices of the folder's
tensors that rank's shards cover (`paralm.train.checkpoint.hf_reads`), and they are the weights `paralm import`
reads: Mixtral's and DeepSeek's experts one expert at a time (a rank of ep 2 opens its experts' tensors only),
the rest split by ZeRO-3; GPT-2's q, k and v from the fused, transposed `c_attn` under TP; DeepSeek's
interleaved RoPE rows with a ZeRO-3 shard boundary inside a head's RoPE rows, DeepSeek-V2's and Moonlight's two
shared experts (one MLP twice an expert's width) split by ZeRO-3; transformers' stacked expert layout. Bytes are
counted as safetensors hands tensors out (`get_tensor`, `get_slice`), whatever path reads them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paralm.config.load import load_config
from paralm.models import mixtral_hf
from paralm.models.hf_folder import load_tensors, read_folder
from paralm.models.registry import model_spec
from paralm.parallel.parallelize import parallelize
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.checkpoint.init_from import load_init
from tests.multiprocess import run_ranks

transformers = pytest.importorskip("transformers")

# DeepSeek: 3 heads of 4 + 8 rows (wq: 36 rows, ZeRO-3's boundary at 18, inside head 1's RoPE rows 16..23) and a
# latent of 6 (wkv_a: 6 + 8 rows, the boundary at 7, inside its RoPE rows)
FOLDERS = {  # name: (class, config class, fields)
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "deepseek": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            num_attention_heads=3,
            num_key_value_heads=3,
            moe_intermediate_size=20,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            kv_lora_rank=6,
            qk_rope_head_dim=8,
            qk_nope_head_dim=4,
            v_head_dim=8,
            first_k_dense_replace=1,
            q_lora_rank=None,
        ),  # fmt: skip
    ),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=32, n_head=4, n_layer=2, n_positions=32)),
}
# DeepSeek-V2's routing (2 shared experts, groups by their best score, no renormalisation; 4 heads, as its config
# wants them to divide hidden_size) and Moonlight's shape
V2_ROUTING = dict(n_shared_experts=2, topk_method="group_limited_greedy", n_group=2, topk_group=1, norm_topk_prob=False)
V2_ROUTING |= dict(num_attention_heads=4, num_key_value_heads=4)
FOLDERS["deepseek_v2"] = ("DeepseekV2ForCausalLM", "DeepseekV2Config", FOLDERS["deepseek"][2] | V2_ROUTING)
FOLDERS["moonlight"] = ("DeepseekV3ForCausalLM", "DeepseekV3Config", FOLDERS["deepseek"][2] | {"n_shared_experts": 2})
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
SHAPE |= dict(num_key_value_heads=2, max_position_embeddings=32)


def _save(path: Path, name: str) -> Path:
    """A transformers model with every weight (and DeepSeek's balancing bias) moved off its initial value."""
    cls, config_cls, fields = FOLDERS[name]
    shape = dict(activation_function="gelu", vocab_size=64) if name == "gpt2" else SHAPE
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, config_cls)(**(shape | fields)))
    with torch.no_grad():
        for tensor in (*model.parameters(), *(b for n, b in model.named_buffers() if "correction_bias" in n)):
            tensor.add_(torch.randn_like(tensor) * 0.05)
    model.save_pretrained(path, max_shard_size="40KB")
    return path


def _config(folder: Path, *overrides: str):
    return load_config(None, [f"--checkpoint.init_from={folder}", *overrides], init_model=True)


def _imported(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's weights as `paralm import` reads them: every tensor whole, mapped by `from_hf`."""
    config, hf = _config(folder), read_folder(folder)
    return model_spec(config.model).hf.from_hf(load_tensors(hf), config.model, hf.source)


def _assert_weights(loaded: dict[str, torch.Tensor], folder: Path) -> None:
    imported = _imported(folder)
    assert set(imported) <= set(loaded), set(imported) - set(loaded)
    for name, tensor in imported.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", ["gpt2", "deepseek", "deepseek_v2", "moonlight", "mixtral-stacked"])
def test_one_process_reads_what_import_reads(tmp_path, name):
    """GPT-2's fused c_attn, DeepSeek's RoPE rows and the stacked expert layout (`gate_up_proj`) map as import maps."""
    folder = _save(tmp_path / "hf", name.removesuffix("-stacked"))
    config = _config(folder)
    if name == "mixtral-stacked":
        files = sorted(folder.glob("*.safetensors"))
        weights = {k: v for file in files for k, v in load_file(file).items()}
        for file in [*files, folder / "model.safetensors.index.json"]:
            file.unlink()
        save_file(mixtral_hf.stacked(weights, config.model), folder / "model.safetensors")
    model = model_spec(config.model).build(config.model)
    load_init(str(folder), model, config, None, None)
    _assert_weights(model.state_dict(), folder)


def _counting_reads() -> dict[str, int]:
    """Bytes of each tensor safetensors hands out from now on in this process, by tensor name."""
    import safetensors

    opened, read = safetensors.safe_open, {}

    class Slice:
        def __init__(self, name: str, part) -> None:
            self.name, self.part = name, part

        def __getitem__(self, index):
            tensor = self.part[index]
            read[self.name] = read.get(self.name, 0) + tensor.numel() * tensor.element_size()
            return tensor

        def __getattr__(self, attribute: str):
            return getattr(self.part, attribute)

    class File:
        def __init__(self, *args, **kwargs) -> None:
            self.file = opened(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.file.__exit__(*exc)

        def get_tensor(self, name: str) -> torch.Tensor:
            return Slice(name, self.file.get_slice(name))[:]

        def get_slice(self, name: str) -> Slice:
            return Slice(name, self.file.get_slice(name))

        def __getattr__(self, attribute: str):
            return getattr(self.file, attribute)

    safetensors.safe_open = File
    return read


def _load_on_rank(folder: str, overrides: list[str]) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """Build the model as `paralm train` does (meta device, parallelized), load `folder` into it counting the
    bytes read; returns them and the model's weights gathered whole."""
    read = _counting_reads()
    config = _config(Path(folder), *overrides)
    runtime = init_runtime(config.parallel, config.sync)
    with torch.device("meta"):
        model = model_spec(config.model).build(config.model)
    model = parallelize(model, runtime, config).model
    load_init(folder, model, config, runtime.group, None)
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    shutdown(runtime)
    return read, whole


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, parallel",
    [
        ("mixtral", {"ep": 2, "zero": 3}),
        ("deepseek", {"ep": 2, "zero": 3}),
        ("deepseek_v2", {"ep": 2, "zero": 3}),
        ("moonlight", {"ep": 2, "zero": 3}),
        ("gpt2", {"tp": 2}),
    ],
    ids=["mixtral-ep2-zero3", "deepseek-ep2-zero3", "deepseek-v2-ep2-zero3", "moonlight-ep2-zero3", "gpt2-tp2"],
)
def test_each_rank_reads_its_slices_only(tmp_path, name, parallel):
    """Each of 2 ranks reads about half the folder, a rank of ep 2 the tensors of its 2 experts of 4 only, and
    the shards, gathered, are the weights import reads."""
    folder = _save(tmp_path / "hf", name)
    sizes = {k: v.numel() * v.element_size() for k, v in load_tensors(read_folder(folder)).items()}
    overrides = [f"--parallel.{k}={v}" for k, v in parallel.items()]
    for rank, (read, loaded) in enumerate(run_ranks(_load_on_rank, 2, tmp_path, str(folder), overrides)):
        _assert_weights(loaded, folder)
        assert sum(read.values()) <= 0.6 * sum(sizes.values()), (rank, sum(read.values()), sum(sizes.values()))
        experts = {k: int(m.group(1)) for k in sizes if (m := re.search(r"\.experts\.(\d+)\.", k))}
        assert {experts[k] for k in read if k in experts} == ({2 * rank, 2 * rank + 1} if experts else set())
        assert sum(read.get(k, 0) for k in experts) <= 0.5 * sum(sizes[k] for k in experts)
