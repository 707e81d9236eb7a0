"""The `quantize` and `prune` verbs."""

from __future__ import annotations

import argparse

from paralm.convert.schemes import SCHEMES
from paralm.errors import refuse_overrides


def _quantize(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.compress.quantize import quantize_run

    refuse_overrides("quantize", overrides)
    print(quantize_run(args.run, args.scheme, args.out, args.checkpoint))
    return 0


def _prune(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.compress.prune import prune_run

    refuse_overrides("prune", overrides)
    print(prune_run(args.run, args.sparsity, args.method, args.out, args.checkpoint))
    return 0


def add_compress_verbs(verbs: argparse._SubParsersAction) -> None:
    quantize = verbs.add_parser("quantize", help="quantize a run's linear layers with torchao (a new run folder)")
    quantize.add_argument("--run", required=True, help="run directory")
    quantize.add_argument("--checkpoint", help="checkpoint directory (default: the latest)")
    quantize.add_argument("--scheme", required=True, help=f"one of {', '.join(SCHEMES)}")
    quantize.add_argument("--out", required=True, help="new run folder (eval and generate load it)")
    quantize.set_defaults(func=_quantize)

    prune = verbs.add_parser("prune", help="prune a run's linear layers: a new run with a step-0 checkpoint and masks")
    prune.add_argument("--run", required=True, help="run directory")
    prune.add_argument("--checkpoint", help="checkpoint directory (default: the latest)")
    prune.add_argument("--sparsity", type=float, required=True, help="fraction of weights (or units) to remove, [0, 1)")
    prune.add_argument("--method", default="magnitude", help="magnitude (per-layer, unstructured) or structured")
    prune.add_argument("--out", required=True, help="new run directory; fine-tune it with paralm train")
    prune.set_defaults(func=_prune)
