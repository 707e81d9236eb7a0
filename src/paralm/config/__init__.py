"""Configuration, the bottom floor: the schema, TOML and overrides, every rule, the degrees left open, the
parallel dims and the pipeline schedules. It imports nothing of paralm but the models' own sections."""
