"""lm-evaluation-harness on paralm runs: a model adapter of paralm's own and the `paralm eval --tasks` verb."""
