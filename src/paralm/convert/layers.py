"""Which linear layers compression touches: those of each block's residual branches, as the family's
spec names them (`ModelSpec.branches`). Embeddings and the head are left as they are (the head may be
the embedding, tied)."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from paralm.errors import UserError
from paralm.models.spec import Branch, ModelSpec


def canonical(name: str) -> str:
    """A parameter's full-model name: without the attributes wrappers insert (`_checkpoint_wrapped_module`,
    `_orig_mod`), as checkpoints name it."""
    return ".".join(part for part in name.split(".") if not part.startswith("_"))


def branch_layers(model: nn.Module, spec: ModelSpec) -> Iterator[tuple[str, Branch]]:
    """(`blocks.<i>.<module>` prefix, branch) for every block and branch the model holds. A branch whose
    layers are not linear layers (a mixture-of-experts layer's experts are weight tensors) is refused in
    one line: nothing is compressed that is not there, and nothing there is skipped."""
    for key in model.get_submodule(spec.blocks):
        for branch in spec.branches:
            prefix = f"{spec.blocks}.{key}.{branch.module}"
            module = model.get_submodule(prefix)
            for name in (*branch.inputs, branch.output):
                if not isinstance(getattr(module, name, None), nn.Linear):
                    raise UserError(
                        f"{prefix} is a {type(module).__name__} without the linear layer {name!r} (model.moe_experts "
                        "> 0?): quantization, pruning, QAT and FP8 do not handle mixture-of-experts layers yet; "
                        "use a dense model"
                    )
            yield prefix, branch


def linear_names(model: nn.Module, spec: ModelSpec) -> list[str]:
    """The module names of the blocks' linear layers (inputs and outputs of every branch)."""
    return [f"{prefix}.{name}" for prefix, b in branch_layers(model, spec) for name in (*b.inputs, b.output)]
