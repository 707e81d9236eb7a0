"""paralm: train GPT-style language models with every major parallel strategy, from one config."""

__version__ = "0.1.0"
