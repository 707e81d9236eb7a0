"""Context parallelism: each sequence's positions split across the `cp` ranks of a data-parallel rank.

Every cp rank reads the same sequences and keeps its share of the positions (`layout`); attention, the
one place positions meet, runs across the ranks, by all-to-all (`alltoall`, DeepSpeed Ulysses) or
around a ring (`ring`); everything else is per position and runs unchanged on the shard. `apply`
swaps each block's attention through the family's spec.
"""
