"""Converters: module swaps applied before parallelization, and hooks run after each optimizer step."""
