"""Finished runs, read one way (checkpointed, quantized or pruned) and written one way (whole or not at all).

`load_trained_model` is the package's entry: every verb that reads a run (eval, generate, export, quantize,
prune, lm-eval) loads it so."""

from paralm.runs.load import load_trained_model

__all__ = ["load_trained_model"]
