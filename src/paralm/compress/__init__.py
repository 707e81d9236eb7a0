"""Smaller models after training: quantization (torchao), pruning with masks kept through fine-tuning, QAT."""
