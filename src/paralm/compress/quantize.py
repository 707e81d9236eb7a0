"""`paralm quantize`: a run's latest checkpoint, its blocks' linear layers quantized by torchao, as a
run folder that `paralm eval` and `paralm generate` load (`paralm.runs.quantized`)."""

from __future__ import annotations

import json
from pathlib import Path

from paralm.config.schema import CONFIG_FILE
from paralm.convert.layers import linear_names
from paralm.convert.schemes import check_scheme, quantize_layers
from paralm.errors import UserError
from paralm.models.registry import model_spec
from paralm.parallel.runtime import select_device
from paralm.runs import load_trained_model
from paralm.runs.quantized import QUANTIZED_FILE, WEIGHTS_FILE, parts, refuse_quantized
from paralm.runs.write import atomic_folder


def quantize_run(run_dir: str, scheme: str, out: str, checkpoint: str | None = None) -> str:
    """Write the quantized run `out`; returns a one-line summary."""
    from safetensors.torch import save_file

    check_scheme(scheme, select_device(0))
    if not Path(run_dir).is_dir():
        raise UserError(f"run directory {run_dir} does not exist: pass the run.dir of a training run")
    refuse_quantized(run_dir, "quantized again")
    loaded = load_trained_model(run_dir, checkpoint)
    spec = model_spec(loaded.config.model)
    names = linear_names(loaded.model, spec)
    quantize_layers(loaded.model, scheme, names)
    out_dir = Path(out)
    with atomic_folder(out_dir) as tmp:
        tensors = {name: t.contiguous() for name, t in parts(loaded.model, spec).items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "scheme": scheme})
        (tmp / CONFIG_FILE).write_text((loaded.checkpoint / CONFIG_FILE).read_text())
        info = {"scheme": scheme, "source": str(loaded.checkpoint), "layers": names}
        (tmp / QUANTIZED_FILE).write_text(json.dumps(info, indent=1))
    size = (out_dir / WEIGHTS_FILE).stat().st_size
    return f"{out_dir}: {scheme} of {loaded.checkpoint} ({len(names)} linear layers; {size / 1e6:.2f} MB)"
