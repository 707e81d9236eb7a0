"""Task parallelism: many independent paralm runs (a sweep, a batch of configs) scheduled by Ray Tune.

`space` parses the search space, `plan` turns it into validated trials, `runner` is the Tune trainable
that runs one trial as a `paralm train` subprocess, `results` writes what came out, `driver` starts Ray
and Tune, and `cli` is the `paralm sweep` verb. Nothing here imports Ray at module level except
`runner` and `driver`, so parsing and validation work (and fail fast) before Ray starts.
"""
