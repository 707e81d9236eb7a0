"""Hugging Face interop, a wing: `paralm export` (a run as a transformers folder) and `paralm import` (back)."""
